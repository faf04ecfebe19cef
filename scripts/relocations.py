#!/usr/bin/env python3
"""What the relative relocations of a position-independent keel are: the pointers the dynamic
loader writes at every start (docs/deploy.md, "Where start-up and idle memory go").

    python3 scripts/relocations.py BINARY [--table NAME=GLOB ...]

Each relocation is classified by the pointer it writes: into code (function pointers: vtables,
callbacks), into other data, or into read-only data. A pointer into read-only data followed by
a length is read as a `&str`: a path ending in `.rs` is a panic location (`file!()` of an
`unwrap` or a bounds check); any other string is looked up in the tables given, each NAME the
string literals of the Rust files GLOB matches (a registry crate's tables, a build script's
output), first table first. What matches no table stays "other strings" (format strings, log
metadata, names of serde fields). So the tables' figures are estimates: a short string that two
crates both hold counts for the first table that has it.

BINARY needs no symbols; it must have been linked with packed relocations (DT_RELR, keel's
default where the linker can) or with plain `R_X86_64_RELATIVE` ones. x86_64 ELF only.
"""

import argparse
import collections
import glob
import re
import struct
import subprocess


def sections(path):
    """(address, size, file offset, name) of each section that is loaded."""
    found = []
    listing = subprocess.run(["readelf", "-SW", path], capture_output=True, text=True, check=True)
    for line in listing.stdout.splitlines():
        m = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m and int(m.group(2), 16):
            found.append((int(m.group(2), 16), int(m.group(4), 16), int(m.group(3), 16), m.group(1)))
    return sorted(found)


def relative_relocations(path, data, secs):
    """The addresses the loader adds its load address to."""
    addresses = []
    for address, size, offset, name in secs:
        if name != ".relr.dyn":
            continue
        # DT_RELR: an even entry is an address; an odd one a bitmap of the 63 words after
        # the last address or bitmap.
        base = 0
        for at in range(offset, offset + size, 8):
            entry = struct.unpack_from("<Q", data, at)[0]
            if entry & 1 == 0:
                addresses.append(entry)
                base = entry + 8
            else:
                addresses.extend(base + 8 * bit for bit in range(63) if entry >> (bit + 1) & 1)
                base += 63 * 8
    listing = subprocess.run(["readelf", "-rW", path], capture_output=True, text=True, check=True)
    for line in listing.stdout.splitlines():
        m = re.match(r"([0-9a-f]{12,16})\s+[0-9a-f]+\s+R_X86_64_RELATIVE\b", line)
        if m:
            addresses.append(int(m.group(1), 16))
    return addresses


def string_literals(pattern):
    literals = set()
    for path in glob.glob(pattern, recursive=True):
        try:
            with open(path, encoding="utf-8", errors="ignore") as source:
                literals.update(re.findall(r'"((?:[^"\\]|\\.){1,200})"', source.read()))
        except (IsADirectoryError, PermissionError):
            continue
    return literals


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--table", action="append", default=[], metavar="NAME=GLOB")
    args = parser.parse_args()
    tables = []
    for table in args.table:
        name, _, pattern = table.partition("=")
        tables.append((name, string_literals(pattern)))

    with open(args.binary, "rb") as binary:
        data = binary.read()
    secs = sections(args.binary)

    def section_of(address):
        for start, size, offset, name in secs:
            if start <= address < start + size:
                return name, offset + address - start
        return None, None

    kinds = collections.Counter()
    relocations = relative_relocations(args.binary, data, secs)
    for address in relocations:
        _, at = section_of(address)
        if at is None:
            kinds["in no loaded section"] += 1
            continue
        target = struct.unpack_from("<Q", data, at)[0]
        target_section, target_at = section_of(target)
        if target_section is None:
            kinds["pointers to nothing loaded (a length, an offset)"] += 1
        elif target_section.startswith(".text"):
            kinds["function pointers (vtables, callbacks)"] += 1
        elif target_section != ".rodata":
            kinds["pointers to other data"] += 1
        else:
            length = struct.unpack_from("<Q", data, at + 8)[0] if at + 16 <= len(data) else 1 << 40
            try:
                text = data[target_at : target_at + length].decode() if length <= 4096 else None
            except UnicodeDecodeError:
                text = None
            if text is None:
                kinds["pointers to read-only data (tables, not strings)"] += 1
            elif text.endswith(".rs") and "/" in text:
                kinds["panic locations (file names)"] += 1
            else:
                kinds[next((name for name, strings in tables if text in strings), "other strings")] += 1
    print(f"{len(relocations)} relative relocations")
    for kind, count in kinds.most_common():
        print(f"{count:8}  {kind}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Labels questions.src against the State of the Union corpus: writes questions.tsv.

Usage: label.py <corpus folder of .txt speeches> questions.src > questions.tsv

Each output line: the question, a tab, the relevant speeches (file names, comma-separated),
a tab, the labelling phrase. A question whose phrase is in no speech, or in more than 12, is
refused: it would not label a findable, specific answer.
"""
import pathlib
import sys

corpus, source = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
speeches = {p.name: p.read_text(encoding="utf-8").lower() for p in sorted(corpus.glob("*.txt"))}
bad = False
for line in source.read_text(encoding="utf-8").splitlines():
    if not line.strip() or line.startswith("#"):
        continue
    question, phrase = (part.strip() for part in line.split("|"))
    relevant = [name for name, text in speeches.items() if phrase.lower() in text]
    if not relevant or len(relevant) > 12:
        print(f"refused ({len(relevant)} speeches): {phrase}", file=sys.stderr)
        bad = True
        continue
    print(f"{question}\t{','.join(relevant)}\t{phrase}")
sys.exit(1 if bad else 0)

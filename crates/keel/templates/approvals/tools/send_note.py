"""The send_note tool: appends {"to", "text"} to outbox.txt and says so."""
import json
import sys

note = json.load(sys.stdin)
with open("outbox.txt", "a", encoding="utf-8") as outbox:
    outbox.write(f"to {note['to']}: {note['text']}\n")
print(f"sent to {note['to']}")

"""The word_count tool: reads {"text": ...} on stdin, prints how many words it has."""
import json
import sys

call = json.load(sys.stdin)
print(len(call["text"].split()))

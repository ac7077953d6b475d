"""Rebuild tests/durations.json (seconds per test file; tests/conftest.py runs the heaviest files
first) from the `--durations=0` table of a run of the CI's test line:

  .venv/bin/python -m pytest -q -n 2 --dist loadfile tests --durations=0 -p no:cacheprovider \\
      | tee durations.txt
  .venv/bin/python scripts/test_durations.py durations.txt
"""
import collections
import json
import os
import re
import sys

ROW = re.compile(r"\s*([\d.]+)s\s+(?:setup|call|teardown)\s+tests/(test_\w+\.py)::")


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__, file=sys.stderr)
    return 2
  secs: collections.Counter = collections.Counter()
  with open(argv[0]) as f:
    for line in f:
      m = ROW.match(line)
      if m:
        secs[m.group(2)] += float(m.group(1))
  if not secs:
    print(f"no --durations rows in {argv[0]}", file=sys.stderr)
    return 1
  out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                     "durations.json")
  table = {"source": os.path.basename(argv[0]),
           "seconds": {k: round(v, 1) for k, v in secs.most_common()}}
  with open(out, "w") as f:
    json.dump(table, f, indent=1)
    f.write("\n")
  print(f"{out}: {len(secs)} files, {sum(secs.values()):.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""A process the truncation tests (``test_truncation.py``) drive line by line: each line
on stdin is a JSON string of Python code, run in one namespace kept across lines; each
reply is one JSON line on stdout: ``{"ok": result}`` (the value the code left in
``result``, if any) or ``{"raised": [type name, message]}``. The process lives until its
stdin closes; a crash (a SIGBUS, say) shows as its exit status.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
import traceback

STEP = 30.0


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the code prints does not mix with the replies
    ns: dict = {"STEP": STEP, "os": os, "pickle": pickle, "base64": base64}
    for line in sys.stdin:
        ns.pop("result", None)
        try:
            exec(json.loads(line), ns)
            reply: dict = {"ok": ns.get("result")}
        except Exception as e:
            traceback.print_exc()
            reply = {"raised": [type(e).__name__, str(e)]}
        out.write(json.dumps(reply, default=repr) + "\n")
        out.flush()


if __name__ == "__main__":
    main()

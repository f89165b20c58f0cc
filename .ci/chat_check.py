"""Waits for a freshly installed `k3serve serve` on 127.0.0.1:8000, then asks the README's chat request.

Standard library only: it runs in the serve environment, which has no test extras. Exit 0 when /health
answers and the chat answer is the README's tool call; one line and exit 1 otherwise.
"""

import json
import os
import sys
import time
import urllib.request

BASE = "http://127.0.0.1:8000"
REQUEST = {
    "model": "k3-default", "temperature": 0,
    "messages": [{"role": "user", "content": 'Can you book the hotel?\ncity: "Paris"\nnights: 3'}],
    "tools": [{"type": "function", "function": {
        "name": "book_hotel", "description": "Use this to book the hotel.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}},
                       "required": ["city", "nights"]}}}],
}


def wait_healthy(pid: int, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("serve check: the README's serve command exited before /health answered")
        try:
            with urllib.request.urlopen(BASE + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    sys.exit(f"serve check: /health did not answer within {deadline_s:.0f} s")


def main() -> None:
    wait_healthy(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 1200)
    req = urllib.request.Request(BASE + "/v1/chat/completions", data=json.dumps(REQUEST).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        message = json.load(r)["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "book_hotel":
        sys.exit(f"serve check: expected a book_hotel call, got {json.dumps(message)}")
    args = json.loads(calls[0]["function"]["arguments"])
    if args != {"city": "Paris", "nights": 3}:
        sys.exit(f"serve check: wrong arguments {args}")
    print(f"serve check: /health 200, chat answered {calls[0]['function']['name']}({json.dumps(args)})")


if __name__ == "__main__":
    main()

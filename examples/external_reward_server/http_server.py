"""A standalone reward model over HTTP, in slime's remote_rm format: copy this file, replace `score`, run it, and
point slipstream at it with `slipstream reward --rm-type remote_rm --rm-url http://HOST:PORT/score`.

Request: POST JSON {"prompt": str, "response": str, "label": str}. Answer: a number, or a JSON object whose
"score" (or --reward-key) is the reward and whose other numbers are logged as details. Standard library only.

Run: python http_server.py --port 8060 [--fail-first N]   (--fail-first answers 503 N times, to try retries)
"""

import argparse
import json
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def score(prompt: str, response: str, label: str) -> dict:
    """Edit me. Here: 1 if the last number in the response equals the label."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", response)
    correct = bool(numbers) and label.strip() != "" and float(numbers[-1]) == float(label)
    return {"score": float(correct), "length": float(len(response))}


class Handler(BaseHTTPRequestHandler):
    failures_left = 0

    def do_POST(self) -> None:
        if Handler.failures_left > 0:
            Handler.failures_left -= 1
            self.send_error(503, "warming up")
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = json.dumps(score(body.get("prompt", ""), body.get("response", ""), body.get("label", ""))).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args) -> None:  # quiet: one line per request is too much at RL rates
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8060)
    parser.add_argument("--fail-first", type=int, default=0)
    args = parser.parse_args()
    Handler.failures_left = args.fail_first
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"reward model listening on http://{args.host}:{server.server_port}/score", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

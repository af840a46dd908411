"""The command line: `python -m scripts.local_kaggle serve|user-add|token-add|secret-attach ...` (from the repository
root)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from . import __doc__ as package_doc
from .app import LocalKaggle
from .rules import DEFAULT_GPU_QUOTA_HOURS, DEFAULT_SESSION_LIMIT_S, DEFAULT_TPU_QUOTA_HOURS, DEFAULT_WORKING_CAP_BYTES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.local_kaggle", description=package_doc.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the server")
    serve.add_argument("--root", required=True, help="state folder (datasets, kernels, blobs, users, secrets)")
    serve.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: pick one and print it)")
    serve.add_argument("--session-limit", type=float, default=DEFAULT_SESSION_LIMIT_S, help="seconds per session")
    serve.add_argument("--working-cap-gb", type=float, default=DEFAULT_WORKING_CAP_BYTES / 1e9)
    serve.add_argument("--quota-hours", type=float, default=DEFAULT_TPU_QUOTA_HOURS, help="weekly TPU hours")
    serve.add_argument("--gpu-quota-hours", type=float, default=DEFAULT_GPU_QUOTA_HOURS, help="weekly GPU hours")
    serve.add_argument("--queue-delay", type=float, default=0.3, help="seconds a pushed version stays queued")
    serve.add_argument("--dataset-ready-delay", type=float, default=0.0,
                       help="seconds before a new dataset version is ready")
    serve.add_argument("--user", action="append", default=[], metavar="NAME:KEY",
                       help="add a user (also read: KAGGLE_USERNAME/KAGGLE_KEY of this process)")
    serve.add_argument("--faults", help="a JSON file with a list of faults to inject")
    serve.add_argument("--verbose", action="store_true")
    for name, help_ in (("user-add", "add a user; the key is read from stdin"),
                        ("secret-attach", "attach a secret to a notebook (owner/slug); the value is read from stdin")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--root", required=True)
        p.add_argument("user" if name == "user-add" else "kernel")
        if name == "secret-attach":
            p.add_argument("name")
    token = sub.add_parser("token-add", help="make a user a new-style API token (KGAT_...), printed as the "
                                             "settings page shows it once; send it as KAGGLE_API_TOKEN")
    token.add_argument("--root", required=True)
    token.add_argument("user")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    if args.cmd == "token-add":
        print(LocalKaggle(args.root).add_api_token(args.user))
        return 0
    if args.cmd in ("user-add", "secret-attach"):
        value = sys.stdin.readline().rstrip("\n")
        if not value:
            parser.error("nothing read from stdin")
        app = LocalKaggle(args.root)
        if args.cmd == "user-add":
            app.add_user(args.user, value)
        else:
            app.attach_secret(args.kernel, args.name, value)
        return 0

    users = {}
    for spec in args.user:
        name, sep, key = spec.partition(":")
        if not sep:
            parser.error(f"--user {spec!r}: expected NAME:KEY")
        users[name] = key
    if os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY"):
        users.setdefault(os.environ["KAGGLE_USERNAME"], os.environ["KAGGLE_KEY"])
    faults = json.loads(Path(args.faults).read_text()) if args.faults else None
    app = LocalKaggle(
        args.root,
        port=args.port,
        session_limit_s=args.session_limit,
        working_cap_bytes=int(args.working_cap_gb * 1e9),
        tpu_quota_hours=args.quota_hours,
        gpu_quota_hours=args.gpu_quota_hours,
        queue_delay_s=args.queue_delay,
        dataset_ready_delay_s=args.dataset_ready_delay,
        users=users,
        faults=faults,
        verbose=args.verbose,
    )
    app.start()
    if not app.users():
        print("local-kaggle: warning: no users; add one with --user NAME:KEY or user-add", file=sys.stderr)
    print(f"local-kaggle: serving {app.root} on port {app.port}", flush=True)
    print(f"  export KAGGLE_API_ENVIRONMENT=LOCALHOST HTTP_PROXY={app.proxy_url} NO_PROXY=", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: app.stop_soon())
    app.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

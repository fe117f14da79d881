"""``scripts/stack``: start, inspect and stop the local production stack (see ``stack/services.py``).

    scripts/stack up                 # PostgreSQL, S3 (moto), MLflow server, Prefect server; writes .stack/env
    scripts/stack workers 2          # two Prefect workers of the pool `retrain`, each on a host of its own
    scripts/stack exec n0 -- CMD...  # run CMD on host n0 (made if missing) with the stack's client environment
    scripts/stack env                # the export lines (source <(scripts/stack env))
    scripts/stack status
    scripts/stack down               # stop everything, remove the hosts, forget the state
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from stack.services import Stack, StackError

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", type=Path, default=Path(os.environ.get("RETRAIN_STACK", ROOT / ".stack")),
                        help="state folder (default .stack/ in the clone, or $RETRAIN_STACK)")
    parser.add_argument("--prefix", default="rts", help="name prefix of the stack's namespaces and links")
    parser.add_argument("--net", default="10.231.7", help="first three octets of the stack's /24")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    sub.add_parser("down")
    sub.add_parser("env")
    sub.add_parser("status")
    w = sub.add_parser("workers")
    w.add_argument("n", type=int)
    e = sub.add_parser("exec")
    e.add_argument("host")
    e.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    stack = Stack.at(args.state, args.prefix, args.net)
    try:
        if args.cmd == "up":
            stack.up()
            print(f"stack up; state in {stack.state}")
            print(f"  MLflow UI:  {stack.mlflow_url}")
            print(f"  Prefect UI: {stack.prefect_api.removesuffix('/api')}")
            print(f"  use it:     source {stack.state / 'env'}   (then retrain init DIR --remote "
                  f"$RETRAIN_DVC_REMOTE/NAME)")
        elif args.cmd == "down":
            stack.down()
            print("stack down: nothing of it runs, its hosts and state are gone")
        elif args.cmd == "env":
            if not (stack.state / "env").is_file():
                raise StackError(f"no stack at {stack.state}: scripts/stack up")
            print((stack.state / "env").read_text(), end="")
        elif args.cmd == "status":
            for name, ok in stack.status().items():
                print(f"{name:<12} {'up' if ok else 'DOWN'}")
        elif args.cmd == "workers":
            hosts = stack.workers(args.n)
            print(", ".join(f"{h} ({stack.net.address(h)})" for h in hosts) or "no workers")
        elif args.cmd == "exec":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            return stack.popen(args.host, command).wait()
    except (StackError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A process that takes a run's lease when told: the other writer in tests/test_lease.py.

    python tests/leaseholder.py STORE_ROOT ENDPOINT TIMEOUT_S EXPERIMENT/RUN_ID

It opens the store (ENDPOINT "-" for a local one) and makes its lease, says ``ready``, then obeys one command
per line on stdin and answers each with one JSON line on stdout:

    acquire   take the lease of the run (the whole run, no waiting):
              {"acquired": owner} or {"busy": message}
    write     write the artifact EXPERIMENT/RUN_ID/iter-000000/rollout: {"wrote": uri} or {"fenced": message}
    check     the lease's check(): {"ok": owner} or {"lost": message}

At the end of stdin it leaves the lease (as ``drmas run`` does when it ends). Warnings
(e.g. a takeover) go to stderr.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import ExitStack

from drmas.infra.lease import RunBusy, RunLease
from drmas.infra.store import Store


def main(root: str, endpoint: str, timeout_s: str, run: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    store = Store(root, None if endpoint == "-" else endpoint, lease_timeout_s=float(timeout_s))
    lease, held = RunLease(store, *run.split("/")), ExitStack()  # ready to race: its S3 client is made
    say("ready")
    for line in sys.stdin:
        command = line.strip()
        try:
            if command == "acquire":
                held.enter_context(lease)
                say({"acquired": lease.owner})
            elif command == "write":
                with store.writer(f"{run}/iter-000000/rollout", overwrite=True) as out:
                    out.write_bytes("trajectories.parquet", b"rows")
                say({"wrote": store.uri(f"{run}/iter-000000/rollout")})
            elif command == "check":
                lease.check()
                say({"ok": lease.owner})
        except RunBusy as error:
            say({"busy" if command == "acquire" else "fenced" if command == "write" else "lost": str(error)})
    held.close()


def say(message: object) -> None:
    print(json.dumps(message), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

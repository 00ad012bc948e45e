"""The script torchrun starts for each worker of an integration test's launch (launch.torchrun):
`python -u worker.py EXAMPLE ARGS...`, standard library only (a new interpreter starts in
~0.05 s). It asks the test module's preloaded process (launch.preloaded: Lightning,
transformers or Accelerate imported once, ~5 s of CPU a worker otherwise) to fork a process
that runs EXAMPLE as `python -u EXAMPLE ARGS...` would, in this process's environment (the
RANK, MASTER_PORT... torchrun set), directory and standard streams. This process stands in
for it towards torchrun: it passes on every signal torchrun sends, and ends as the worker
ended (its exit code, or killed by the same signal). Should this process die first (SIGKILL),
the worker kills itself (launch._watch)."""

import json
import os
import signal
import socket
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    path = os.environ["THINWIRE_TEST_PRELOADED"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 300
    while True:                      # the server may still be importing
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    spec = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(sock, [len(spec).to_bytes(8, "big") + spec], [0, 1, 2])
    replies = sock.makefile("rb")
    pid = int(replies.readline())
    for sig in FORWARDED:
        signal.signal(sig, lambda received, _frame: os.kill(pid, received))
    line = replies.readline()        # the worker's exit code (negative: the signal that ended it)
    code = int(line) if line.strip() else -signal.SIGKILL
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()

"""The ``moonbright`` command that pip installs: ``moonbright demo``, ``moonbright replay
TRACE`` and ``moonbright bench-traces DIR``, the same program as the Rust binary
``cargo run -p moonbright-cli`` builds, run from this package's extension module.
``moonbright --help`` lists the options."""

from __future__ import annotations

import signal
import sys

from . import _moonbright


def main(argv: list[str] | None = None) -> int:
    """Runs the command with ``argv`` (default ``sys.argv``; its first item is the program's
    name) and returns its exit status; as a console script, the status of the process."""
    args = list(sys.argv if argv is None else argv)
    if not args:
        args = ["moonbright"]
    args[0] = "moonbright"
    # The command runs in Rust without the GIL, where Python's KeyboardInterrupt would wait
    # for it to end: Ctrl-C stops it at once, as it stops the Rust binary.
    if argv is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    return _moonbright.cli_main(args)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m tspbench`` and the ``tspbench`` script. Signals are held from the first line, so
a SIGTERM that arrives while torch is still importing is not lost (:mod:`tspbench.runtime.guard`).
"""

from tspbench.runtime.guard import hold_signals

hold_signals()

from tspbench.cli import main  # noqa: E402  (after the signals are held)

if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m tspbench`` and the ``tspbench`` script. Signals are held from the first line, so
a SIGTERM that arrives while torch is still importing is not lost, and a rank spawned by
``--launch local`` shows from then on that it still runs (:mod:`tspbench.runtime.guard`).
"""

from tspbench.runtime.guard import hold_signals, start_heartbeat

hold_signals()
start_heartbeat()

from tspbench.cli import main  # noqa: E402  (after the signals are held)

if __name__ == "__main__":
    raise SystemExit(main())

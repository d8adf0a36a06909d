"""`flashmemory serve`'s stop: Ctrl-C (SIGINT) stops it even when its parent started it with SIGINT ignored."""

import signal
import subprocess
import sys
import textwrap

_SERVE = textwrap.dedent("""
    import argparse, sys
    import flashmemory.serve.stack as st
    from flashmemory.serve import cli
    st.ensure_model = lambda p: p                                          # no model build, no servers:
    st.start_pd = lambda servers, cfg, router_port=None: st.PDStack("r", "p", "d", {})   # a stack that is up
    args = argparse.Namespace(model=sys.argv[1], ckpt="none", port=0, stock=True, hisparse=False, logs=sys.argv[2],
                              startup_timeout=5.0)
    sys.exit(cli.run(args))
""")


def test_sigint_stops_serve_even_when_inherited_as_ignored(tmp_path):
    """A background job of a non-interactive shell, or a pytest-xdist worker's child, starts with SIGINT ignored;
    Python then installs no KeyboardInterrupt handler. `flashmemory serve` installs its own (a live run under
    xdist once waited out its 120 s for a Ctrl-C that did nothing)."""
    p = subprocess.Popen(
        [sys.executable, "-c", _SERVE, str(tmp_path), str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        seen = []
        for line in p.stdout:
            seen.append(line)
            if line.startswith("READY "):
                break
        assert seen and seen[-1].startswith("READY "), "".join(seen)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
        assert "stopped: all servers gone" in p.stdout.read()
    finally:
        p.kill()

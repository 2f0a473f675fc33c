"""Precompile tests compile on 2 shared cores: no inductor worker pool in any process."""

from __future__ import annotations

import os

# Inherited by the ranks and scripts the tests start. A pool of compile workers costs a
# process start per core and buys nothing for the tiny graphs compiled here.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

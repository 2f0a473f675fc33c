"""``cadence bench KIND --link SPEC``: the same benchmark, its ranks on an emulated link.

This process makes the link (`cadence.link.EmulatedLink`), checks its rate, and runs
``cadence bench KIND`` again inside it, without ``--link``; the inner run reads the
link from its environment and keeps it in the record (``settings``), with the rate
the self-check measured, which is what turns bytes into wire time. ``--link
calibrated`` (``step`` only) is `cadence.bench._calibrate`, which runs this module's
inner command once per case and rate.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cadence.errors import CadenceValueError

__all__ = ["CALIBRATED", "bench_on_link", "check_not_inside", "inner_argv"]

CALIBRATED = "calibrated"


def inner_argv(kind: str, *, quick: bool, results: Path, cases: list[str] | None) -> list[str]:
    """The command line of the run inside the link."""
    argv = [sys.executable, "-m", "cadence", "bench", kind, "--results", str(results.resolve())]
    if quick:
        argv.append("--quick")
    if cases:
        argv += ["--cases", ",".join(cases)]
    return argv


def check_not_inside() -> None:
    """A link inside a link would measure neither: refuse before making one."""
    from cadence.link import active_link

    if active_link() is not None:
        raise CadenceValueError(
            "--link given inside an emulated link already (CADENCE_LINK is set): "
            "drop --link, or run from outside the link"
        )


def bench_on_link(
    kind: str, link: str, *, quick: bool, results: Path, cases: list[str] | None
) -> int:
    """Run ``cadence bench KIND`` inside an emulated link; its exit status."""
    from cadence.link import EmulatedLink, LinkSpec

    check_not_inside()
    spec = LinkSpec.parse(link)
    with EmulatedLink(spec) as emulated:
        print(emulated.self_check().line(spec), flush=True)
        return emulated.run(inner_argv(kind, quick=quick, results=results, cases=cases))

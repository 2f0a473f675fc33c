"""Interactively defined code and long-lived workers: a driver script run as ``__main__``
ships functions, classes, instances and typing objects to workers and back (class
identity across round trips, isolation of globals, determinism of re-pickled classes).

The driver (``_interactive_driver.py``) runs once per protocol; each of its sections is
one test here, failing with the section's own traceback.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from tests.pickling._harness import run_script

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

DRIVER = Path(__file__).with_name("_interactive_driver.py")
SECTIONS = [
    "interactive_functions_and_classes",
    "interactive_global_variable_isolation",
    "interactive_remote_function_calls",
    "interactive_remote_calls_no_side_effect",
    "dynamic_class_and_remote_instances",
    "dynamic_class_and_stored_remote_instances",
    "interactive_enum",
    "interactive_abc",
    "interactive_dataclass",
    "typing_objects_tracked_across_processes",
    "class_with_type_hints_in_worker",
    "registered_module_constructs_in_a_worker_that_cannot_import_it",
    "registered_module_globals_follow_the_driver",
    "dynamic_module_forwarded_by_a_worker",
    "no_memory_leak_across_calls",
    "deterministic_chained_class_pickling",
    "deterministic_str_interning_for_chained_dynamic_classes",
    "deterministic_tuple_memoization_in_a_sub_worker",
    "dynamic_function_and_class_bytes_same_in_two_processes",
]


@functools.cache
def _results(protocol: int) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as cwd:
        return run_script(DRIVER, str(protocol), cwd=Path(cwd))


def test_every_section_reports():
    assert sorted(_results(5)) == sorted(SECTIONS)


@pytest.mark.parametrize("name", SECTIONS)
def test_section(protocol, name):
    result = _results(protocol).get(name, "section did not run")
    assert result == "ok", result

"""The Platform contract stays small, documented, and cheap for device backends."""

from __future__ import annotations

import inspect
from pathlib import Path

import hyperpar_cpu
import hyperpar_cuda
import hyperpar_npu

from hyperpar.platform import Platform, abstract_members


def test_contract_has_at_most_45_abstract_members():
    assert len(abstract_members()) <= 45, abstract_members()


def test_every_abstract_member_has_a_docstring():
    undocumented = [n for n in abstract_members() if not inspect.getdoc(getattr(Platform, n))]
    assert not undocumented, f"document these Platform members: {undocumented}"


def test_device_backends_stay_well_under_100_lines():
    for package in (hyperpar_cpu, hyperpar_cuda, hyperpar_npu):
        source = Path(package.__file__).with_name("platform.py")
        lines = len(source.read_text().splitlines())
        assert lines < 100, f"{source}: {lines} lines"


def test_in_tree_backends_implement_the_whole_contract():
    for package in (hyperpar_cpu, hyperpar_cuda, hyperpar_npu):
        cls = next(v for k, v in vars(package).items() if k.endswith("Platform"))
        assert not inspect.isabstract(cls), (cls, cls.__abstractmethods__)

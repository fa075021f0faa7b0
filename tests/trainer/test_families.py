"""The trainer's model families as the other services read them: which have routed experts is declared once
(`services.common.model_types.MOE_MODEL_TYPES`, read by the reference engine without megatron-core) and agrees with
the families the registry builds."""

import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")


def test_the_moe_families_are_those_built_with_routed_experts():
    from services.common.model_types import MOE_MODEL_TYPES
    from services.trainer.families import FAMILIES
    from services.trainer.families.base import MOE

    assert {name for name, family in FAMILIES.items() if MOE.keys() <= family.rules.keys()} == set(MOE_MODEL_TYPES)


def test_the_engine_reads_them_without_megatron():
    code = (
        "import sys; from services.engine.routing import MOE_MODEL_TYPES; "
        "assert 'megatron' not in ' '.join(sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

"""services/trainer/megatron_import.py: megatron-core imported without torch's compiler, its fused functions compiled
on their first call."""

import subprocess
import sys

from services.trainer.megatron_import import _on_first_call

CHECK = """
import sys, torch
from services.trainer.megatron_import import import_megatron
import_megatron()
from megatron.core import jit
from megatron.core.fusions import fused_bias_gelu
print("torch._dynamo" in sys.modules, torch.compile is jit.jit_fuser.args[0], fused_bias_gelu.bias_gelu.__name__)
"""


def test_a_trainer_process_imports_megatron_without_torchs_compiler():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "bias_gelu"]


def test_a_fused_function_is_compiled_once_on_its_first_call_with_its_options():
    compiled = []

    def compile_now(function, **options):
        compiled.append(options)
        return lambda *args: function(*args) * 10

    @_on_first_call(compile_now, mode="max-autotune")
    def add(a, b):
        return a + b

    assert compiled == []
    assert (add(1, 2), add(3, 4)) == (30, 70)
    assert compiled == [{"mode": "max-autotune"}]
    assert _on_first_call(compile_now)(add).__name__ == "add"

"""Config files plus flags, and the one-sentence errors a user sees for bad settings."""

import re

import pytest
import yaml

from services.buffer.config import BufferConfig
from services.common.config import ConfigError, StrictModel, load_config, printable


def load(argv):
    return load_config(BufferConfig, argv, prog="slipstream buffer")


def test_defaults():
    config = load([])
    assert config.port == 50051
    assert config.redis.url is None
    assert str(config.run_dir) == "runs/default"


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("port: 6000\nrun_id: exp1\nredis:\n  prefix: team\n  url: redis://localhost:6379/0\n")
    config = load(["--config", str(path), "--port", "7000", "--redis-prefix", "mine"])
    assert (config.port, config.run_id) == (7000, "exp1")
    assert (config.redis.prefix, config.redis.url) == ("mine", "redis://localhost:6379/0")


def test_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('port = 6001\n[redis]\nprefix = "t"\n')
    config = load(["--config", str(path)])
    assert (config.port, config.redis.prefix) == (6001, "t")


def test_null_from_a_flag():
    assert load(["--metrics-port", "none"]).metrics_port is None


def test_unknown_key_names_the_closest_field(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("redis:\n  urll: redis://x\n")
    with pytest.raises(ConfigError, match=r'run.yaml: redis.urll: unknown setting; did you mean "url"\?'):
        load(["--config", str(path)])


def test_wrong_type_names_the_flag():
    with pytest.raises(ConfigError, match=r"^--port: Input should be a valid integer.*got 'abc'"):
        load(["--port", "abc"])


def test_out_of_range_names_the_field(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("port: 70000\n")
    with pytest.raises(ConfigError, match=r"run.yaml: port: Input should be less than or equal to 65535"):
        load(["--config", str(path)])


def test_every_bad_field_is_reported(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("port: x\nbogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load(["--config", str(path)])
    assert len(str(info.value).splitlines()) == 2


def test_unknown_flag_suggests_the_right_one():
    with pytest.raises(ConfigError, match="unknown option --redis-urll; did you mean --redis-url"):
        load(["--redis-urll", "x"])


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml does not exist; check the path given to --config"):
        load(["--config", str(tmp_path / "nope.yaml")])


def test_invalid_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("port: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load(["--config", str(path)])


def test_file_must_be_a_mapping(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of settings, not a list"):
        load(["--config", str(path)])


def test_unsupported_format(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("{}")
    with pytest.raises(ConfigError, match=r"unsupported format '\.json'; use \.yaml, \.yml or \.toml"):
        load(["--config", str(path)])


def test_print_config(capsys):
    with pytest.raises(SystemExit) as info:
        load(["--print-config", "--port", "1234"])
    assert info.value.code == 0
    assert "port: 1234" in capsys.readouterr().out


def test_print_config_shows_no_password_of_a_url(capsys):
    with pytest.raises(SystemExit):
        load_config(BufferConfig, ["--print-config", "--redis-url", "redis://:s3cret@redis:6379/0"], prog="buffer")
    out = capsys.readouterr().out
    assert "url: redis://:***@redis:6379/0" in out and "s3cret" not in out


@pytest.mark.parametrize(
    ("shown", "printed"),
    [
        ("user:s3cret@buffer:50051", "user:***@buffer:50051"),  # no scheme: a gRPC address
        ("redis://:s3cret@a:6379/0,redis://:s3cret@b:6379/0", "redis://:***@a:6379/0,redis://:***@b:6379/0"),
        ("redis://:s3c@ret@host/0", "redis://:***@host/0"),  # an @ in the password: the last one ends it
        ("https://rm.example/score?api_key=s3cret&n=1#top", "https://rm.example/score?api_key=***&n=1#top"),
        ("dns:///buffer:50051", "dns:///buffer:50051"),
        ("pkg.module:function", "pkg.module:function"),
    ],
)
def test_printable_hides_every_password_of_a_url(shown, printed):
    class Settings(StrictModel):
        value: str
        values: list[str] = []

    assert printable(Settings(value=shown, values=[shown])) == {"value": printed, "values": [printed]}


def test_printable_hides_secret_settings_and_options():
    """The engine's --api-key, a reward function's password, and --api-key KEY passed through to SGLang."""

    class Settings(StrictModel):
        api_key: str | None = None
        engine_api_key_file: str = "/run/key"  # a path, shown
        custom_rm_args: dict = {}
        sglang_args: list[str] = []

    settings = Settings(api_key="k", custom_rm_args={"password": "p"}, sglang_args=["--api-key", "k", "--x=1"])
    assert printable(settings) == {
        "api_key": "***",
        "engine_api_key_file": "/run/key",
        "custom_rm_args": {"password": "***"},
        "sglang_args": ["--api-key", "***", "--x=1"],
    }
    assert printable(Settings(sglang_args=["--sglang-api-key=k"]))["sglang_args"] == ["--sglang-api-key=***"]


def test_the_wandb_run_config_shows_no_password():
    from services.train.options import TrainOptions

    logged = printable(TrainOptions(wandb_host="https://user:s3cret@wandb.example", wandb_key="s3cret"))
    assert "s3cret" not in str(logged) and logged["wandb_host"] == "https://user:***@wandb.example"


def test_a_flat_group_keeps_its_flags_and_keys(tmp_path):
    """The trainer's loss settings are one model (`config.loss`), passed whole, yet keep slime's flat names: on the
    command line, in a config file, as keyword arguments, in --print-config and in errors."""
    from services.trainer.config import LossSettings, TrainerConfig

    assert TrainerConfig(eps_clip=0.3).loss == LossSettings(eps_clip=0.3)
    (tmp_path / "t.yaml").write_text("use_kl_loss: true\nkl_loss_coef: 0.1\n")
    config = load_config(TrainerConfig, ["--config", str(tmp_path / "t.yaml"), "--eps-clip", "0.3"], prog="t")
    assert (config.loss.eps_clip, config.loss.use_kl_loss, config.loss.kl_loss_coef) == (0.3, True, 0.1)
    shown = printable(config)
    assert "loss" not in shown and shown["eps_clip"] == 0.3
    (tmp_path / "shown.yaml").write_text(yaml.safe_dump(shown))
    assert load_config(TrainerConfig, ["--config", str(tmp_path / "shown.yaml")], prog="t") == config
    with pytest.raises(ConfigError, match=r"^--eps-clip-c: Input should be greater than 1"):
        load_config(TrainerConfig, ["--eps-clip-c", "0.5"], prog="t")
    (tmp_path / "bad.yaml").write_text("eps_clipp: 0.3\n")
    with pytest.raises(ConfigError, match=r'bad.yaml: eps_clipp: unknown setting; did you mean "eps_clip"\?'):
        load_config(TrainerConfig, ["--config", str(tmp_path / "bad.yaml")], prog="t")
    with pytest.raises(ConfigError, match="unknown option --loss-eps-clip"):
        load_config(TrainerConfig, ["--loss-eps-clip", "0.3"], prog="t")


def test_the_optimizer_and_the_parallel_layout_are_flat_groups_too():
    """The optimizer's and the parallel layout's settings are groups (`config.optimizer`, `config.parallel`), passed
    whole, with Megatron's flat flags; a group's field also reads by its flat name."""
    from services.trainer.config import OptimizerSettings, ParallelSettings, TrainerConfig

    flags = ["--lr", "1e-5", "--clip-grad", "0.5", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    config = load_config(TrainerConfig, flags, prog="t")
    assert config.optimizer == OptimizerSettings(lr=1e-5, clip_grad=0.5)
    assert config.parallel == ParallelSettings(tensor_model_parallel_size=2, sequence_parallel=True)
    assert (config.lr, config.tensor_model_parallel_size) == (1e-5, 2)
    shown = printable(config)
    assert "optimizer" not in shown and "parallel" not in shown and shown["lr"] == 1e-5
    with pytest.raises(ConfigError, match=r"^--adam-beta2: Input should be less than 1"):
        load_config(TrainerConfig, ["--adam-beta2", "1"], prog="t")
    with pytest.raises(ConfigError, match="sequence_parallel splits sequences over tensor-parallel ranks"):
        load_config(TrainerConfig, ["--sequence-parallel"], prog="t")


def test_a_negative_number_in_any_notation_is_a_value_not_a_flag():
    from services.trainer.config import TrainerConfig

    for value in ("-1e-3", "-0.001", "-1E+2", "-.5"):
        with pytest.raises(ConfigError, match=rf"--lr: Input should be greater than 0 \(got '{re.escape(value)}'\)"):
            load_config(TrainerConfig, ["--lr", value], "slipstream trainer")
    assert load_config(TrainerConfig, ["--lr", "1e-3"], "slipstream trainer").lr == 1e-3

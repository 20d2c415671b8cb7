"""The typed training configuration: every shipped config loads, overrides keep their types, and bad
values are refused up front with the key named, before anything is traced."""

import glob
import os
import warnings

import pytest
import yaml

import retrace_jax as rj
import train
from retrace_jax.errors import ConfigError
from retrace_jax.models.tiny import TINY_QWEN3
from retrace_jax.training.config import TrainConfig, describe, load_config
from retrace_jax.training.loop import check_resume, run_settings, step_options
from retrace_jax.training.retrace_loss import loss_weights
from retrace_jax.training.step import StepOptions, adamw

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target": "tiny", "out": str(tmp_path / "out"), "train": {"steps": 5}}))
    return str(path)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig) and cfg.train.steps >= 1
    assert cfg["train"]["lr"] == cfg.train.lr  # the dict-style reads work too


def test_overrides_are_typed(config):
    cfg = load_config(config, ["train.lr=1e-3", "train.steps=7", "drafter.target_layer_ids=[1, 2]",
                               "train.mesh=data=2,tensor=2", "train.remat=true"])
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 7 and cfg.drafter.target_layer_ids == [1, 2]
    assert cfg.train.mesh == "data=2,tensor=2" and cfg.train.remat is True
    assert load_config(config, ["train.lr=1"]).train.lr == 1.0  # an int where a float is expected


@pytest.mark.parametrize("override, message", [
    ("train.clip=0", "--set train.clip: must be > 0, got 0"),
    ("train.lr=0", "--set train.lr: must be > 0, got 0"),
    ("train.lr=-1e-4", "--set train.lr: must be > 0, got '-1e-4'"),
    ("train.lr=.nan", "--set train.lr: must be a finite number"),
    ("train.remat=yes please", "--set train.remat: expected true or false, got 'yes please'"),
    ("train.remat=1", "--set train.remat: expected true or false, got 1"),
    ("train.gamma=0", "--set train.gamma: must be > 0, got 0"),
    ("train.gamma=fast", "--set train.gamma: expected a number, got 'fast'"),
    ("train.correction_source=oracle", "--set train.correction_source: must be 'verify' or 'teacher', got 'oracle'"),
    ("train.objective=eagle", "--set train.objective: must be 'dflash' or 'retrace', got 'eagle'"),
    ("train.memory_dtype=int8", "--set train.memory_dtype: must be 'float32', 'bfloat16' or 'float16'"),
    ("train.rounds=1", "--set train.rounds: must be >= 2, got 1"),
    ("train.round_weights=[1.0, x]", "--set train.round_weights[1]: expected a number, got 'x'"),
    ("train.round_weights=[1.0, 2.0]", "train.round_weights: 2 weights for 4 rounds"),
    ("train.round1_weight=-1", "--set train.round1_weight: must be >= 0, got -1"),
    ("train.mesh=model=4", "--set train.mesh: unknown mesh axis 'model'"),
    ("train.mesh=data=1,data=1", "--set train.mesh: mesh axis 'data' is named twice"),
    ("train.steps=0", "--set train.steps: must be >= 1, got 0"),
    ("train.steps=1e3", "--set train.steps: expected an integer, got '1e3'"),
    # steps count micro-steps: 5 of 3 each would leave 2 never applied, 5 of 8 no optimizer update at all
    ("train.grad_accum=3", "train.steps: 5 is not a multiple of train.grad_accum 3"),
    ("train.grad_accum=8", "train.steps: 5 is smaller than train.grad_accum 8"),
    ("train.num_anchors=200", ("train.num_anchors: 200 exceeds the 121 anchor positions of a 128-token sequence "
                               "(train.seq_len) with block size 8 (drafter.block_size)")),
    ("train.seed=true", "--set train.seed: expected an integer, got True"),
    ("train.warmup_frac=1.5", "--set train.warmup_frac: must be < 1, got 1.5"),
    ("train.tensorboard=maybe", "--set train.tensorboard: expected true, false or auto, got 'maybe'"),
    ("train.distributed=1", "--set train.distributed: expected true, false or auto, got 1"),
    ("drafter.block_size=1", "--set drafter.block_size: must be >= 2, got 1"),
    ("drafter.block_size='8'", "--set drafter.block_size: expected an integer, got '8'"),
    ("drafter.block_size=8.7", "--set drafter.block_size: expected an integer, got 8.7"),
    ("drafter.target_layer_ids=[1, x]", "--set drafter.target_layer_ids[1]: expected an integer, got 'x'"),
    ("drafter.target_layer_ids=[2.9]", "--set drafter.target_layer_ids[0]: expected an integer, got 2.9"),
    ("drafter.target_layer_ids=[]", "--set drafter.target_layer_ids: must not be empty"),
    ("drafter.draft_vocab=0", "--set drafter.draft_vocab: must be >= 1, got 0"),
    ("drafter.init_layers=[1, 2]", "drafter.init_layers: needs one target layer per drafter layer (1), got [1, 2]"),
    ("drafter.init_layers=[x]", "--set drafter.init_layers[0]: expected an integer, got 'x'"),
    ("retrace.signals=all", "--set retrace.signals: must be 'drafter', 'target' or 'both', got 'all'"),
    ("retrace.gate='false'", "--set retrace.gate: expected true or false, got 'false'"),
    ("retrace.rank=2.5", "--set retrace.rank: expected an integer, got 2.5"),
    ("data.temperature=-1", "--set data.temperature: must be >= 0, got -1"),
    ("data.drop_long_prompts='false'", "--set data.drop_long_prompts: expected true or false, got 'false'"),
    ("data.thinking=no thanks", "--set data.thinking: expected true or false, got 'no thanks'"),
    ("data.prompts=[a, b]", "--set data.prompts: expected a string, got ['a', 'b']"),
    ("target=123", "--set target: expected a string, got 123"),
    ("target_precision=float16", "--set target_precision: must be 'float32' or 'bfloat16', got 'float16'"),
    ("out=5", "--set out: expected a string, got 5"),
    ("train.nope=1", "--set train.nope: unknown key"),
    ("train.stpes=1", "--set train.stpes: unknown key; did you mean 'steps'?"),
    ("train=3", "--set train: expected a mapping, got 3"),
])
def test_bad_values_are_refused_up_front(config, override, message, capsys):
    with pytest.raises(ConfigError) as err:
        load_config(config, [override])
    assert message in str(err.value)
    with pytest.raises(SystemExit) as exit_:  # train.py: one line, non-zero, before touching anything
        train.main(["--config", config, "--set", override])
    assert exit_.value.code == 1
    text = capsys.readouterr().err
    assert text.startswith("error: ") and message in text and text.count("\n") == 1


def test_all_problems_are_reported_together(config):
    with pytest.raises(ConfigError) as err:
        load_config(config, ["train.clip=0", "train.lr=0"])
    assert "train.lr" in str(err.value) and "train.clip" in str(err.value)


def test_problems_in_the_file_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target: tiny\ndrafter:\n  block_size: '8'\ndata:\n  drop_long_prompts: 'false'\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), ["train.steps=0"])
    message = str(err.value)
    assert f"{path}: drafter.block_size: expected an integer, got '8'" in message
    assert f"{path}: data.drop_long_prompts: expected true or false, got 'false'" in message
    assert "--set train.steps: must be >= 1, got 0" in message
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match=rf"{path}: expected a mapping, got \['a list'\]"):
        load_config(str(path))


def test_numbers_that_yaml_reads_as_strings_are_numbers_where_a_number_is_due(tmp_path):
    """PyYAML reads ``1e-3`` (no dot) as a string: a float key takes it as the number it is, an integer
    key does not."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n  weight_decay: 1\n")
    cfg = load_config(str(path))
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.weight_decay, float)
    path.write_text("train:\n  steps: 1e3\n")
    with pytest.raises(ConfigError, match=r"train\.steps: expected an integer, got '1e3'"):
        load_config(str(path))


def test_round_weights_and_their_short_form(config):
    """``round1_weight`` (the key of two-round training) still weighs round 1 against 1.0 for every later
    round; ``round_weights`` gives one weight per round; both at once are refused."""
    cfg = load_config(config, ["train.objective=retrace"])
    assert cfg.train.rounds == 4 and step_options(cfg).rounds == 4
    assert loss_weights(cfg.train.rounds, cfg.train.round_weights, cfg.train.round1_weight) == (1.0,) * 4
    opts = step_options(load_config(config, ["train.round1_weight=0.5", "train.rounds=3"]))
    assert loss_weights(opts.rounds, opts.round_weights, opts.round1_weight) == (0.5, 1.0, 1.0)
    opts = step_options(load_config(config, ["train.round_weights=[2, 0, 1.5]", "train.rounds=3"]))
    assert opts.round_weights == (2, 0, 1.5)
    assert loss_weights(opts.rounds, opts.round_weights, opts.round1_weight) == (2.0, 0.0, 1.5)
    with pytest.raises(ConfigError) as err:
        load_config(config, ["train.round1_weight=0.5", "train.round_weights=[1, 1, 1, 1]"])
    assert "train.round_weights: given with train.round1_weight" in str(err.value)
    with pytest.raises(ValueError, match="not both"):
        StepOptions(objective="retrace", round1_weight=0.5, round_weights=(1.0, 1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="one weight per round"):
        StepOptions(objective="retrace", rounds=3, round_weights=(1.0, 1.0))
    with pytest.raises(ValueError, match="rounds must be an integer >= 2"):
        StepOptions(objective="retrace", rounds=1)


def test_resume_checks_rounds_and_reads_older_retrace_checkpoints_as_two_rounds(config):
    class Saved:
        def __init__(self, meta):
            self.meta = meta

        def read_meta(self, step):
            return self.meta

        def verify(self, step):  # checksums recorded and matching
            return True

    drafter_cfg = rj.init_drafter(TINY_QWEN3, mask_token_id=127, num_layers=1, block_size=4).cfg
    four = run_settings(load_config(config, ["train.objective=retrace"]), drafter_cfg, 10)
    two = run_settings(load_config(config, ["train.objective=retrace", "train.rounds=2"]), drafter_cfg, 10)
    assert (four["rounds"], four["round_weights"], four["round1_weight"]) == (4, [1.0] * 4, 1.0)
    check_resume(Saved(four), 5, four, "out")
    with pytest.raises(ConfigError, match="rounds: 2 then, 4 now"):
        check_resume(Saved(two), 5, four, "out")
    older = {k: v for k, v in two.items() if k not in ("rounds", "round_weights")}  # before train.rounds
    check_resume(Saved(older), 5, two, "out")
    with pytest.raises(ConfigError, match="rounds: 2 then, 4 now"):
        check_resume(Saved(older), 5, four, "out")
    dflash = run_settings(load_config(config), drafter_cfg, 10)  # rounds mean nothing to DFlash
    assert dflash["rounds"] is None and dflash["round_weights"] is None


def test_step_options_and_optimizer_check_their_arguments():
    with pytest.raises(ValueError, match="correction_source"):
        StepOptions(objective="retrace", correction_source="x")
    with pytest.raises(ValueError, match="gamma"):
        StepOptions(gamma=-1.0)
    with pytest.raises(ValueError, match="remat"):
        StepOptions(remat="yes")
    with pytest.raises(ValueError, match="clip"):
        adamw(1e-3, 10, clip=0.0)
    with pytest.raises(ValueError, match="lr"):
        adamw(0.0, 10)


def test_describe_lists_every_key():
    text = describe()
    cfg = TrainConfig().to_dict()
    for section, keys in cfg.items():
        if isinstance(keys, dict):
            for key in keys:
                assert f"  {key}: " in text, key
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert train.main(["--describe"]) is None


def test_steps_count_micro_steps_in_whole_optimizer_updates(config):
    """train.steps counts micro-steps (checkpoints and resume number them): with grad_accum it must be a
    whole number of optimizer updates, which --describe says."""
    cfg = load_config(config, ["train.steps=6", "train.grad_accum=3"])
    assert (cfg.train.steps, cfg.train.grad_accum) == (6, 3)
    with pytest.raises(ConfigError, match=r"train\.steps: 2 is smaller than train\.grad_accum 3") as err:
        load_config(config, ["train.steps=2", "train.grad_accum=3"])
    assert "no optimizer update" in str(err.value)
    steps = next(line for line in describe().splitlines() if line.startswith("  steps: "))
    assert "micro-steps" in steps and "multiple of grad_accum" in steps


def test_the_old_error_name_still_works_with_a_warning():
    import retrace_jax.training.config as training_config

    with pytest.warns(DeprecationWarning, match="ConfigurationError is now retrace_jax.ConfigError"):
        assert training_config.ConfigurationError is rj.ConfigError


def test_a_renamed_key_keeps_working(config, monkeypatch):
    from retrace_jax.training.config import TrainSection

    monkeypatch.setattr(TrainSection, "RENAMED", {"learning_rate": "lr"})
    with pytest.warns(DeprecationWarning, match="'train.learning_rate' is now 'train.lr'"):
        cfg = load_config(config, ["train.learning_rate=2e-3"])
    assert cfg.train.lr == 2e-3


def test_multi_process_launches_are_detected(monkeypatch):
    from retrace_jax.parallel import distributed

    for key in ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(key, raising=False)
    assert not distributed.launch_detected()
    assert distributed.initialize("auto") is False and distributed.initialize(False) is False
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not distributed.launch_detected()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.launch_detected()
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    assert distributed.launch_detected()
    monkeypatch.setenv("JAX_PROCESS_ID", "first")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID must be an integer, got 'first'"):
        distributed.initialize("auto")


def test_assignments_are_checked(config):
    cfg = load_config(config)
    cfg.train.steps = 7
    cfg["data"]["thinking"] = True
    assert cfg.train.steps == 7 and cfg.data.thinking is True
    with pytest.raises(ConfigError, match=r"^train\.steps: expected an integer, got '5'$"):
        cfg.train.steps = "5"
    with pytest.raises(ConfigError, match=r"^data\.drop_long_prompts: expected true or false, got 'false'$"):
        cfg["data"]["drop_long_prompts"] = "false"


def test_a_config_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"train:\n  steps: 3\n  lr: 0.001 # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: line 3: not UTF-8 \(byte 0xe9\)"):
        load_config(str(path))

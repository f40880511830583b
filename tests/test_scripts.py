"""scripts/: the launchers' --dry-run output (each printed line is run through a shell parser and compared
with the argv it must run), their option errors, the SLURM template's per-node setup, `jaxrl train
--cluster auto`'s errors. A process that joins as a task of a fake two-node SLURM job and trains with a
peer: tests/test_multihost.py (its two processes join one by flags, one by `--cluster auto`)."""

import os
import shlex
import subprocess

import pytest
from conftest import REPO
from multihost_helpers import CLUSTER_VARS, DIST_VARS

SCRIPTS = REPO / "scripts"
CONFIG = "configs/grpo_arithmetic.py"
SPACED = "data.prompt_template=Q: {q} it's A:"  # a space, braces and a quote must all survive
PASSED = ["--set", SPACED, "--set", "train.steps=3"]


def script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # From the repository's root, where CONFIG (relative) is: the launchers refuse a config that is not there.
    return subprocess.run(
        ["bash", str(SCRIPTS / name), *args], capture_output=True, text=True, env=env, timeout=30, cwd=REPO
    )


def lines(result: subprocess.CompletedProcess) -> list[list[str]]:
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines()]


def test_tpu_pod_dry_run_runs_one_train_command_on_every_worker():
    (ssh,) = lines(script("launch_tpu_pod.sh", "--name", "pod", "--zone", "us-central2-b", "--workdir",
                          "/mnt/runs/a b", "--dry-run", CONFIG, *PASSED))  # fmt: skip
    remote = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod", "--zone", "us-central2-b", "--worker=all"]
    assert ssh[:-2] == remote and ssh[-2] == "--command"
    train = [".venv/bin/jaxrl", "train", CONFIG, "--workdir", "/mnt/runs/a b", "--cluster", "auto"]
    assert shlex.split(ssh[-1]) == ["cd", "jaxrl", "&&", *train, "--init-timeout", "300", *PASSED]


def test_tpu_pod_dry_run_syncs_and_installs_first():
    options = ["--name", "pod", "--zone", "z", "--project", "proj", "--workdir", "/w", "--repo-dir", "src/jaxrl"]
    out = lines(
        script("launch_tpu_pod.sh", *options, "--sync", "--install", "--init-timeout", "60", "--dry-run", CONFIG)
    )
    archive, scp, unpack, install, train = out
    assert archive[:3] == ["git", "-C", str(REPO)] and archive[3:6] == ["archive", "--format=tar.gz", "-o"]
    where = ["--zone", "z", "--project", "proj", "--worker=all"]
    assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", archive[6], "pod:jaxrl-src.tar.gz", *where]
    for line in (unpack, install, train):
        assert line[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod"] and line[6:-2] == where
    assert shlex.split(unpack[-1]) == ["mkdir", "-p", "src/jaxrl", "&&", "tar", "-xzf", "jaxrl-src.tar.gz", "-C",
                                       "src/jaxrl"]  # fmt: skip
    assert shlex.split(install[-1])[:3] == ["cd", "src/jaxrl", "&&"] and ".[tpu,hf]" in shlex.split(install[-1])
    assert shlex.split(train[-1])[-7:] == [CONFIG, "--workdir", "/w", "--cluster", "auto", "--init-timeout", "60"]


def test_slurm_dry_run_prints_the_sbatch_command_and_the_srun_line():
    sbatch, srun = lines(script("launch_slurm.sh", "--workdir", "/shared/runs/a", "--nodes", "4", "--gpus-per-node",
                                "4", "--partition", "gpu", "--jaxrl", "/venv/bin/python -m jaxrl.cli", "--dry-run",
                                CONFIG, *PASSED))  # fmt: skip
    job_args = [CONFIG, "--workdir", "/shared/runs/a", "--init-timeout", "300", *PASSED]
    assert sbatch == [
        "env",
        "JAXRL_BIN=/venv/bin/python -m jaxrl.cli",
        "sbatch",
        "--ntasks-per-node=1",
        "--partition=gpu",
        "--nodes=4",
        "--gpus-per-node=4",
        str(SCRIPTS / "slurm_train.sbatch"),
        *job_args,
    ]
    assert srun[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"] and srun[3:5] == ["bash", "-c"]
    assert srun[6:] == ["jaxrl-node", "/venv/bin/python", "-m", "jaxrl.cli", "train", *job_args, "--cluster", "auto"]


def test_slurm_template_gives_the_one_process_of_a_node_all_its_gpus(tmp_path):
    """The batch script itself, run with a stand-in `srun` (runs its command once) and a stand-in
    `jaxrl` (prints the device list JAX will get and its argv)."""
    (tmp_path / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (tmp_path / "fake_jaxrl").write_text(
        '#!/bin/bash\necho "devices=${JAX_LOCAL_DEVICE_IDS-unset}"\nprintf "%s\\n" "$@"\n'
    )
    for f in ("srun", "fake_jaxrl"):
        (tmp_path / f).chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", JAXRL_BIN=str(tmp_path / "fake_jaxrl"))
    env.pop("JAX_LOCAL_DEVICE_IDS", None)
    for gpus, devices in (("4", "devices=0,1,2,3"), ("1", "devices=0"), (None, "devices=unset")):
        if gpus is None:
            env.pop("SLURM_GPUS_ON_NODE", None)
        else:
            env["SLURM_GPUS_ON_NODE"] = gpus
        out = script("slurm_train.sbatch", CONFIG, "--set", SPACED, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [devices, "train", CONFIG, "--set", SPACED, "--cluster", "auto"]


def test_reproduce_variants_dry_run_passes_seeds_steps_and_overrides():
    options = ["--seeds", "2", "--steps", "10", "--presets", "grpo,dapo", "--python", "/py/bin/python"]
    listing, study = lines(script("reproduce_variants.sh", *options, "--set", SPACED, "--no-mc-study", "--dry-run"))
    assert listing == ["env", f"PYTHONPATH={REPO}", "/py/bin/python", "-m", "jaxrl.cli", "variants"]
    assert study == ["env", f"PYTHONPATH={REPO}", "/py/bin/python", "benchmarks/variants.py", "--presets", "grpo,dapo",
                     "--seeds", "2", "--steps", "10", "--set", SPACED, "--no-mc-study"]  # fmt: skip
    (_, default_study) = lines(script("reproduce_variants.sh", "--python", "py", "--dry-run"))
    assert default_study[3:] == ["benchmarks/variants.py", "--presets", "all", "--seeds", "3", "--steps", "60"]


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("launch_tpu_pod.sh", ["--name", "p", "--zone", "z", "--workers", "4", CONFIG], "unknown option --workers"),
        ("launch_tpu_pod.sh", ["--zone", "z", "--workdir", "/w", CONFIG], "--name is required"),
        ("launch_tpu_pod.sh", ["--name", "p", "--zone", "z", "--workdir", "/w"], "no CONFIG given"),
        ("launch_tpu_pod.sh", ["--name", "p", "--zone"], "--zone needs a value"),
        ("launch_slurm.sh", ["--workdir", "/w", "--gpus", "8", CONFIG], "unknown option --gpus"),
        ("launch_slurm.sh", ["--workdir", "/w", "--nodes", "two", CONFIG], "--nodes two: expected a positive integer"),
        ("launch_slurm.sh", [CONFIG], "--workdir is required"),
        ("launch_slurm.sh", ["--workdir", "/w", "configs/nope.py"], "config file configs/nope.py not found"),
        ("launch_tpu_pod.sh", ["--name", "p", "--zone", "z", "--workdir", "/w", "nope.py"], "config file nope.py not"),
        ("reproduce_variants.sh", ["--seed", "2"], "unknown option --seed"),
        ("reproduce_variants.sh", ["--steps", "0"], "--steps 0: expected a positive integer"),
    ],
)
def test_a_bad_option_is_a_one_line_error_naming_it(name, args, message):
    out = script(name, *args, "--dry-run")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"{name}: error: {message}") and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize(
    "name,args",
    [
        ("launch_tpu_pod.sh", ["--name", "pod", "--zone", "z", "--workdir", "/w", CONFIG, *PASSED]),
        ("launch_slurm.sh", ["--workdir", "/w", "--nodes", "2", CONFIG, *PASSED]),
        ("reproduce_variants.sh", ["--seeds", "1", "--set", SPACED]),
    ],
)
def test_dry_run_after_the_config_still_only_prints(name, args):
    """A --dry-run typed after CONFIG (among the arguments for jaxrl) prints the same commands as one
    before it and is never passed on: without this the job would really be launched."""
    before, after = script(name, "--dry-run", *args), script(name, *args, "--dry-run")
    assert after.returncode == 0 and after.stdout == before.stdout and before.stdout.strip(), after.stderr
    assert "--dry-run" not in after.stdout


@pytest.fixture()
def no_cluster(monkeypatch):
    for name in list(os.environ):
        if name.startswith(CLUSTER_VARS + DIST_VARS):
            monkeypatch.delenv(name)
    return monkeypatch


def test_cluster_auto_errors(capsys, no_cluster):
    from jaxrl.cli import main

    def error(*args: str) -> str:
        assert main(["train", CONFIG, *args]) == 2
        return capsys.readouterr().err

    assert error("--cluster", "auto").startswith("jaxrl: error: --cluster auto: no cluster environment found (SLURM_")
    assert error("--cluster", "auto", "--process-id", "0", "--coordinator", "h:1") == (
        "jaxrl: error: --cluster auto takes the process layout from the cluster; drop --coordinator, --process-id "
        "(or unset the JAXRL_* variable)\n"
    )
    no_cluster.setenv("JAXRL_CLUSTER", "slurm")
    assert error() == "jaxrl: error: JAXRL_CLUSTER='slurm' (--cluster): expected 'auto'\n"


def test_cluster_auto_finds_a_slurm_job(no_cluster):
    from jaxrl.cli import UserError, build_parser, distributed_args

    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    for name, value in slurm.items():
        no_cluster.setenv(name, value)
    args = build_parser().parse_args(["train", CONFIG, "--init-timeout", "9"])
    assert distributed_args(args) is None  # auto only when asked for
    no_cluster.setenv("JAXRL_CLUSTER", "auto")
    with pytest.raises(UserError, match="no cluster environment found"):  # SLURM_LOCALID is missing
        distributed_args(args)
    no_cluster.setenv("SLURM_LOCALID", "0")
    assert distributed_args(args) == {"cluster": "slurm", "timeout_s": 9}


def test_launchers_warn_about_a_relative_workdir_and_a_config_the_workers_may_not_have(tmp_path):
    """A copy of the launchers in a git repository of their own: a relative --workdir, a config outside
    the repository, untracked, or changed since the commit (--sync copies HEAD) each get one warning
    line; the launch goes on, with the config's path inside the repository."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("launch_tpu_pod.sh", "launch_slurm.sh", "slurm_train.sbatch", "lib.sh"):
        (repo / "scripts" / name).write_text((SCRIPTS / name).read_text())
    (repo / "configs").mkdir()
    for name in ("committed.py", "changed.py"):
        (repo / "configs" / name).write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "c"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    (repo / "configs" / "changed.py").write_text("x = 2\n")
    (repo / "configs" / "untracked.py").write_text("x = 3\n")
    (tmp_path / "outside.py").write_text("x = 4\n")

    def tpu(config: str, workdir: str = "/w") -> tuple[list[str], list[str]]:
        argv = ["bash", "scripts/launch_tpu_pod.sh", "--name", "p", "--zone", "z", "--workdir", workdir, "--dry-run"]
        out = subprocess.run([*argv, config], capture_output=True, text=True, timeout=30, cwd=repo)
        assert out.returncode == 0, out.stderr
        (ssh,) = out.stdout.splitlines()
        return shlex.split(shlex.split(ssh)[-1]), out.stderr.splitlines()

    train, warnings = tpu("configs/committed.py")
    assert warnings == [] and train[3:6] == [".venv/bin/jaxrl", "train", "configs/committed.py"]
    train, warnings = tpu(str(repo / "configs" / "committed.py"), "runs/a")  # absolute: passed repo-relative
    assert train[5] == "configs/committed.py"
    assert warnings == [
        "launch_tpu_pod.sh: warning: --workdir runs/a is relative: each of the workers resolves it from its own "
        "working directory; give an absolute path that every one of them sees"
    ]
    for config in ("configs/changed.py", "configs/untracked.py"):
        assert tpu(config)[1] == [
            f"launch_tpu_pod.sh: warning: config {config} is not committed as it is here: --sync copies the "
            "committed files (HEAD) only"
        ]
    train, warnings = tpu(str(tmp_path / "outside.py"))
    assert train[5] == str(tmp_path / "outside.py") and len(warnings) == 1
    assert warnings[0].startswith(f"launch_tpu_pod.sh: warning: config {tmp_path / 'outside.py'} is outside")
    argv = ["bash", "scripts/launch_slurm.sh", "--workdir", "runs/a", "--dry-run", "configs/changed.py"]
    slurm = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=repo)
    assert slurm.returncode == 0 and slurm.stderr.startswith("launch_slurm.sh: warning: --workdir runs/a is relative")


def test_make_stand_in_builds_what_the_recipe_loads(tmp_path, capsys):
    """scripts/make_stand_in.py: a checkpoint jaxrl loads (tokenizer, chat template, weights) and a
    printed command whose config and overrides load; docs/huggingface.md gives the hf extra's hint as
    the errors do."""
    pytest.importorskip("tokenizers")
    import importlib.util

    from jaxrl.config import load_config
    from jaxrl.data.hf_tokenizer import HF_EXTRA, load_tokenizer
    from jaxrl.models import hf

    spec = importlib.util.spec_from_file_location("make_stand_in", SCRIPTS / "make_stand_in.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(tmp_path / "si")]) == 0
    (line,) = capsys.readouterr().out.splitlines()  # stdout: the command only
    argv = shlex.split(line)
    assert argv[:3] == ["jaxrl", "train", "configs/qwen2.5_0.5b_gsm8k_grpo.py"]
    cfg = load_config(REPO / argv[2], [w for prev, w in zip(argv, argv[1:]) if prev == "--set"])
    tok = load_tokenizer(cfg.model.hf_path)
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert (tok.eos_id, tok.pad_id) == (2, 0) and chat.endswith("2+2?<|im_end|>\n<|im_start|>assistant\n")
    model_cfg, _ = hf.load(cfg.model.hf_path)
    assert model_cfg.vocab_size >= tok.tokenizer.get_vocab_size()
    assert sum(1 for _ in open(cfg.data.train_file)) == 64 and cfg.train.steps == 3
    assert module.main([str(tmp_path / "si")]) == 2  # never over an existing stand-in
    assert HF_EXTRA in (REPO / "docs" / "huggingface.md").read_text()

"""Embedded tasks as TFDS builders, prepared offline into array_record files and read by random access.

No TensorFlow is involved: GeneratorBasedBuilder with file_format='array_record' serializes examples
with TFDS's own protobuf code, and `as_data_source()` reads them back with array_record. The
builder config name encodes every generation parameter, so different configs never share a cache
directory and a repeated load finds the prepared files and generates nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import tensorflow_datasets as tfds

from jaxrl.config import ConfigError, DataConfig
from jaxrl.data import arithmetic, countdown, long_addition, math_jsonl
from jaxrl.data.rewards import VERIFIERS, Verifier

FEATURES = ("id", "prompt", "answer", "info")
_OP_NAMES = {"+": "add", "-": "sub", "*": "mul", "/": "div"}


@dataclasses.dataclass(eq=False)
class TaskBuilderConfig(tfds.core.BuilderConfig):
    params: dict = dataclasses.field(default_factory=dict)  # kwargs of the task's generate_splits


class _TaskBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared plumbing; subclasses name the generator. Bump VERSION when generated data changes."""

    VERSION = tfds.core.Version("1.0.0")
    # Nothing is downloaded, so there is no checksums file to find next to the code. TFDS 4.9.10's
    # default code_path also lazily imports `importlib_resources`, which is absent on Python >= 3.9.
    code_path = None

    def _generator(self):
        raise NotImplementedError

    def _info(self) -> tfds.core.DatasetInfo:
        # Built directly: dataset_info_from_configs() would read metadata files from this package's folder.
        text = {name: tfds.features.Text() for name in FEATURES}
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(text))

    def _split_generators(self, dl_manager):
        config = self.builder_config
        assert config is not None  # every builder here is made with its config (make_builder)
        splits = self._generator()(**config.params)
        return {name: self._generate_examples(records) for name, records in splits.items()}

    def _generate_examples(self, records):
        for record in records:
            yield record["id"], record

    # TFDS prints these banners with termcolor regardless of logging settings.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass


class JaxrlArithmetic(_TaskBuilder, skip_registration=True):
    def _generator(self):
        return arithmetic.generate_splits  # looked up on each build, so tests can observe builds


class JaxrlCountdown(_TaskBuilder, skip_registration=True):
    def _generator(self):
        return countdown.generate_splits


class JaxrlLongAddition(_TaskBuilder, skip_registration=True):
    def _generator(self):
        return long_addition.generate_splits


class JaxrlMathJsonl(_TaskBuilder, skip_registration=True):
    def _generator(self):
        return math_jsonl.generate_splits


_BUILDERS = {
    "arithmetic": JaxrlArithmetic,
    "countdown": JaxrlCountdown,
    "long_addition": JaxrlLongAddition,
    "math_jsonl": JaxrlMathJsonl,
}
_VERIFIERS = {**VERIFIERS, "math_jsonl": math_jsonl.verify_math_answer}


@dataclasses.dataclass(frozen=True)
class RecordSource:
    """Random access to one split: len(), and [i] -> dict of python str."""

    name: str
    source: Any  # a tfds ArrayRecordDataSource, or any sequence of dicts

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, str]:
        n = len(self.source)
        index = int(index)
        if not -n <= index < n:
            raise IndexError(f"record {index} out of range for {self.name} of size {n}")
        record = self.source[index % n]
        return {k: v.decode("utf-8") if isinstance(v, bytes) else str(v) for k, v in record.items()}


@dataclasses.dataclass(frozen=True)
class TaskData:
    task: str
    train: RecordSource
    test: RecordSource
    verifier: Verifier | None  # None for agent suites: their environments score the episodes
    data_dir: str  # the prepared dataset's own folder


def resolve_data_dir(cfg: DataConfig, data_dir: str | None = None) -> str:
    chosen = data_dir or cfg.data_dir or os.environ.get("JAXRL_DATA_DIR") or "~/.cache/jaxrl/tfds"
    return os.path.abspath(os.path.expanduser(chosen))


def task_params(cfg: DataConfig) -> dict:
    """The generator kwargs for `cfg`; the operations are canonicalized so '-+' and '+-' share data."""
    if cfg.task not in _BUILDERS:
        raise ConfigError(f"data.task: got {cfg.task!r}, expected one of {sorted(_BUILDERS)}")
    arithmetic.check_sizes(cfg.num_train, cfg.num_test)
    if cfg.task == "math_jsonl":  # local files: the config name is their content hash
        files = [os.path.abspath(os.path.expanduser(f)) if f else "" for f in (cfg.train_file, cfg.test_file)]
        for field, f in zip(("data.train_file", "data.test_file"), files):
            if f and not os.path.isfile(f):
                raise ConfigError(f"{field}: file {f!r} not found")
        return dict(
            train_file=files[0],
            test_file=files[1],
            prompt_template=cfg.prompt_template,
            num_train=cfg.num_train,
            num_test=cfg.num_test,
            digest=math_jsonl.digest(*files),
        )
    allowed = {"countdown": countdown.OPERATIONS, "long_addition": long_addition.OPERATIONS}
    ops = arithmetic.canonical_operations(cfg.operations, allowed.get(cfg.task, arithmetic.OPERATIONS))
    if cfg.task == "arithmetic":  # fail before TFDS creates any folder
        arithmetic.check_space(cfg.digits, ops, cfg.num_train + cfg.num_test)
    return dict(digits=cfg.digits, operations=ops, num_train=cfg.num_train, num_test=cfg.num_test, seed=cfg.seed)


def config_name(params: dict) -> str:
    """A path-safe name holding every parameter, e.g. 'd2-add-sub-train20000-test500-seed0'."""
    if "digest" in params:  # math_jsonl: files + template + sizes, hashed
        key = json.dumps({k: v for k, v in params.items() if k not in ("train_file", "test_file")}, sort_keys=True)
        return f"jsonl-{params['digest']}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    ops = "-".join(_OP_NAMES[op] for op in params["operations"])
    extra = "".join(
        f"-{k}{v}"
        for k, v in sorted(params.items())
        if k not in ("digits", "operations", "num_train", "num_test", "seed")
    )
    return f"d{params['digits']}-{ops}-train{params['num_train']}-test{params['num_test']}-seed{params['seed']}{extra}"


def make_builder(task: str, params: dict, data_dir: str) -> _TaskBuilder:
    builder_config = TaskBuilderConfig(name=config_name(params), params=params)
    with _quiet_tfds():
        return _BUILDERS[task](config=builder_config, data_dir=data_dir, file_format="array_record")


def load_task(cfg: DataConfig, data_dir: str | None = None) -> TaskData:
    """Prepare the task's splits under the data dir on first use (reused afterwards) and open them.

    data_dir resolves as: the argument, else cfg.data_dir, else $JAXRL_DATA_DIR, else ~/.cache/jaxrl/tfds.
    """
    params = task_params(cfg)
    root = resolve_data_dir(cfg, data_dir)
    builder = make_builder(cfg.task, params, root)
    with _quiet_tfds():
        try:
            builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        except OSError:
            # Another process (e.g. another host) may have renamed the same, identical build into place first.
            builder = make_builder(cfg.task, params, root)
            if not builder.is_prepared():
                raise
        sources = builder.as_data_source()
    assert isinstance(sources, dict)  # split=None: every split, by name
    splits = {}
    for split in ("train", "test"):
        splits[split] = RecordSource(f"{cfg.task}/{builder.builder_config_name}/{split}", sources[split])
        if len(splits[split]) == 0:
            field = "data.num_train" if split == "train" else "data.num_test"
            raise ConfigError(f"{field}: the {split} split of {cfg.task} is empty")
    return TaskData(cfg.task, splits["train"], splits["test"], _VERIFIERS[cfg.task], os.fspath(builder.data_dir))


@contextlib.contextmanager
def _quiet_tfds() -> Iterator[None]:
    """Hide TFDS progress bars and info/warning logs ('Using custom data configuration') while
    preparing; restore the caller's settings afterwards."""
    from tensorflow_datasets.core.utils import tqdm_utils  # the bar switch has a setter but no getter

    bars_were_on = getattr(tqdm_utils, "_active", True)
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    tfds.display_progress_bar(False)
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tfds.display_progress_bar(bars_were_on)
        absl_logger.setLevel(level)

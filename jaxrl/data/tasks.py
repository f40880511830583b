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
from jaxrl.data.registry import Task, check_alphabet, get_task, resolve
from jaxrl.data.rewards import Verifier

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
    verifier: Verifier | None  # None for environments: they score their episodes
    data_dir: str  # the prepared dataset's own folder ("" for records made in memory)
    spec: Task  # what data.task names (jaxrl.data.registry)


def resolve_data_dir(cfg: DataConfig, data_dir: str | None = None) -> str:
    chosen = data_dir or cfg.data_dir or os.environ.get("JAXRL_DATA_DIR") or "~/.cache/jaxrl/tfds"
    return os.path.abspath(os.path.expanduser(chosen))


def task_params(cfg: DataConfig) -> dict:
    """The kwargs of a built-in task's TFDS generator for `cfg` (ConfigError naming the field)."""
    task = get_task(cfg.task)
    if task.params is None:
        raise ConfigError(f"data.task: {cfg.task!r} has no TFDS builder; its records come from its registration")
    return task.params(cfg)


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
    builder = get_task(task).builder
    assert builder is not None  # task_params refused a task without one
    with _quiet_tfds():
        return resolve(builder)(config=builder_config, data_dir=data_dir, file_format="array_record")


def load_task(cfg: DataConfig, data_dir: str | None = None, alphabet: str | None = None) -> TaskData:
    """The task's train and test splits. A built-in task's are prepared under the data dir on first use
    (reused afterwards): data_dir resolves as the argument, else cfg.data_dir, else $JAXRL_DATA_DIR, else
    ~/.cache/jaxrl/tfds. Any other task's are made in memory from its registration (deterministic in
    data.seed). alphabet: the character tokenizer's; a record character outside it is a ConfigError.
    """
    task = get_task(cfg.task)
    if task.builder is None:
        train, test = task.split_records(cfg)
        splits = {"train": RecordSource(f"{cfg.task}/train", train), "test": RecordSource(f"{cfg.task}/test", test)}
        found = TaskData(cfg.task, splits["train"], splits["test"], task.verifier, "", task)
    else:
        found = _prepared(cfg, task, data_dir)
    for split in ("train", "test"):
        if len(getattr(found, split)) == 0:
            field = "data.num_train" if split == "train" else "data.num_test"
            raise ConfigError(f"{field}: the {split} split of {cfg.task} is empty")
    if alphabet is not None and not task.episodic and not task.generated_in_alphabet:
        for split in (found.train, found.test):
            check_alphabet(task, alphabet, [split[i] for i in range(len(split))])
    return found


def _prepared(cfg: DataConfig, task: Task, data_dir: str | None) -> TaskData:
    """A built-in task's TFDS splits, built under the data dir unless already there."""
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
    train, test = (RecordSource(f"{cfg.task}/{builder.builder_config_name}/{s}", sources[s]) for s in ("train", "test"))
    return TaskData(cfg.task, train, test, task.verifier, os.fspath(builder.data_dir), task)


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

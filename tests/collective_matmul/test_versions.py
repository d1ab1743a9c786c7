"""Software stacks: the key (`Software`), the look-up order with ``stale``, and `Tuned` against a bundle of
another stack (issue 21)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from collective_matmul import Bundle, Decomposition, Hardware, OpConfigs, Problem, Tuned
from collective_matmul.client.tuned import ring_hardware
from collective_matmul.planning.models import slot_problems
from collective_matmul.planning.problem import Software, flags_digest, platform_version_of
from collective_matmul.wire.bundle import RoleOverride, TunedConfig
from collective_matmul.wire.lookup import MATCHES, NO_STACK, NOT_MEASURED, by_problem, from_tuned, stack_note, untuned

D = Decomposition.from_id
HW = Hardware(platform="cpu", device_kind="cpu", device_count=8)
OLD, NEW = Software(jax="0.10.2", jaxlib="0.10.2"), Software(jax="0.11.0", jaxlib="0.11.0")
AG = Problem.parse("ag:256x64x128:float32:8")
RING = D("ring-bi-c2-full-dus")


def tuned(problem: Problem, decomposition: Decomposition, software: Software, tuned_at: str = "2026-12-01T00:00:00",
          hardware: Hardware = HW) -> TunedConfig:
    return TunedConfig(problem=problem, hardware=hardware, decomposition=decomposition, time_s=0.8e-3,
                       baseline_s=1e-3, speedup=1.25, software=software, tuned_at=tuned_at)


def test_the_flags_digest_ignores_device_counts_dump_flags_and_order():
    assert flags_digest({}) == ""
    assert flags_digest({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}) == ""
    assert flags_digest({"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_dump_hlo_as_text"}) == ""
    one = flags_digest({"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true --xla_cpu_fast=1"})
    assert len(one) == 16 and int(one, 16) >= 0
    assert flags_digest({"XLA_FLAGS": "--xla_cpu_fast=1  --xla_force_host_platform_device_count=4 "
                                      "--xla_gpu_enable_latency_hiding_scheduler=true"}) == one
    # the two variables merge, as in JAX's compilation cache key; the last value of a flag counts
    assert flags_digest({"XLA_FLAGS": "--xla_cpu_fast=1",
                         "LIBTPU_INIT_ARGS": "--xla_gpu_enable_latency_hiding_scheduler=true"}) == one
    assert flags_digest({"XLA_FLAGS": "--xla_cpu_fast=0 --xla_cpu_fast=1 "
                                      "--xla_gpu_enable_latency_hiding_scheduler=true"}) == one
    assert flags_digest({"XLA_FLAGS": "--xla_cpu_fast=2 --xla_gpu_enable_latency_hiding_scheduler=true"}) != one


def test_the_software_key_is_short_stable_and_detected_with_the_hardware(monkeypatch):
    assert OLD.key == "63f62f16905f69d6"  # what migration 0008 gives a stored config of these versions
    assert len({OLD.key, NEW.key, Software().key, OLD.model_copy(update={"flags": "0" * 16}).key}) == 4
    assert Software.model_validate_json(OLD.canonical_json()) == OLD
    assert Software.of({"jax": "0.10.2", "jaxlib": "0.10.2", "numpy": "2.0"}) == OLD  # a worker's old dict
    jax.devices()  # the backend reads XLA_FLAGS once, when it starts: the flags below are only read back
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=false")
    hw = Hardware.detect()
    assert hw.software == Software.detect() and hw.software.jax == jax.__version__ == hw.jax_version
    assert hw.software.flags == flags_digest({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}) != ""
    assert hw.identity().software is None and hw.identity().key == hw.key  # not the hardware's key
    assert "software" not in json.loads(hw.canonical_json())
    tpu = "PJRT C API\nTFRT TPU v5 lite\nBuilt on Oct 30 2023 03:04:42 (1698660263) cl/577737722"
    assert platform_version_of(tpu) == "PJRT C API TFRT TPU v5 lite Built on Oct 30 2023 03:04:42 (1698660263) " \
                                       "cl/577737722"
    with pytest.raises(ValueError):
        Software(flags="not hex")


def test_a_tuned_config_is_keyed_by_its_stack_and_old_entries_get_their_versions():
    entry = tuned(AG, RING, OLD).model_dump(mode="json")
    del entry["software"]  # a version-2 bundle's entry: its versions only
    old = TunedConfig.model_validate(entry)
    assert old.software == OLD and old.key == (AG.key, HW.key, OLD.key)
    assert TunedConfig.model_validate(tuned(AG, RING, NEW).model_dump(mode="json")).jax_version == "0.11.0"
    with pytest.raises(ValueError, match="is not its software's jax"):
        TunedConfig.model_validate(entry | {"software": NEW.model_dump()})
    bundle = Bundle(configs=[old])
    bundle.add(tuned(AG, D("baseline"), NEW, "2026-12-02T00:00:00"))
    bundle.add(tuned(AG, RING, OLD, "2026-12-03T00:00:00"))  # replaces the old stack's only
    assert [(c.software, c.decomposition.id) for c in bundle.configs] == [(NEW, "baseline"), (OLD, RING.id)]
    assert bundle.lookup(AG, HW, NEW).decomposition == D("baseline")
    assert bundle.lookup(AG, HW).software == OLD  # no stack: the newest


def test_each_match_kind_in_the_look_up_order():
    assert MATCHES == ("override", "exact", "stale", "nearest", "model", "baseline")
    configs = by_problem([tuned(AG, RING, OLD, "2026-12-01T00:00:00"), tuned(AG, D("baseline"), NEW,
                                                                             "2026-12-02T00:00:00")])
    assert from_tuned(AG, configs, OLD) == ("exact", configs[AG.key][0])
    assert from_tuned(AG, configs, NEW)[0] == "exact" and from_tuned(AG, configs, NEW)[1].software == NEW
    newer = Software(jax="0.12.0")
    match, config = from_tuned(AG, configs, newer)
    assert match == "stale" and config.software == NEW  # another stack's, the newest
    assert "another software stack (jax 0.11.0, jaxlib 0.11.0)" in stack_note(match, config, newer)
    assert from_tuned(AG, configs, None) == ("exact", configs[AG.key][1])  # no stack named: the newest
    assert stack_note("exact", config, None) == NO_STACK
    # nearest: a tuned problem of the same collective, by its config of the caller's stack where it has one
    bigger = AG.model_copy(update={"m": 512})
    assert from_tuned(bigger, configs, OLD) == ("nearest", configs[AG.key][0])
    assert from_tuned(bigger, configs, NEW)[1].decomposition == D("baseline")
    other = Problem.parse("rs:256x64x128:float32:8")
    assert from_tuned(other, configs, OLD) is None
    match, decomposition, reason = untuned(other, HW)  # nothing measured: the baseline, and why
    assert (match, decomposition) == ("baseline", Decomposition.baseline()) and reason.startswith(NOT_MEASURED)
    assert untuned(other, HW, "costmodel")[0] == "model"  # only where asked for
    npu = HW.model_copy(update={"platform": "npu", "device_kind": "npu-1"})
    match, decomposition, reason = untuned(other, npu, "costmodel")
    assert (match, decomposition) == ("baseline", Decomposition.baseline())
    assert reason == f"{NOT_MEASURED}, and no cost-model figures for device kind 'npu-1': the baseline"


def mesh_1d():
    return jax.make_mesh((8,), ("model",))


def test_a_bundle_of_another_stack_is_stale_in_tuned_and_its_report_says_so(tmp_path):
    mesh = mesh_1d()
    ring = ring_hardware(mesh, "model")
    mine, other = ring.software, Software(jax="0.0.1", jaxlib="0.0.1")
    x, w = jax.ShapeDtypeStruct((256, 64), jnp.float32), jax.ShapeDtypeStruct((64, 128), jnp.float32)
    problems = slot_problems("allgather_matmul", m=256, k=64, n=128, dtype="float32", axis_size=8)
    Bundle(configs=[tuned(problems["forward"], RING, other, hardware=ring.identity())]).save(tmp_path / "b.json")
    client = Tuned(bundle=tmp_path / "b.json")
    configs = client.configs("qkv", "allgather_matmul", x, w, mesh=mesh, axis="model")
    assert configs.forward == RING
    found = client.resolved_by_role["qkv"]["forward"][1]
    assert (found.match, found.origin, found.software) == ("stale", "bundle", other)
    assert "another software stack (jax 0.0.1, jaxlib 0.0.1)" in found.note and str(mine) in found.note
    report = client.report()
    assert [s.role for s in report.stale] == ["qkv"]
    assert "measured on jax 0.0.1, jaxlib 0.0.1" in str(report) and "stale" in str(report).splitlines()[0]
    # the same bundle entry measured on this process's stack is exact
    Bundle(configs=[tuned(problems["forward"], RING, mine, hardware=ring.identity())]).save(tmp_path / "b.json")
    client = Tuned(bundle=tmp_path / "b.json")
    client.configs("qkv", "allgather_matmul", x, w, mesh=mesh, axis="model")
    assert client.resolved_by_role["qkv"]["forward"][1].match == "exact" and not client.report().stale


def test_an_override_of_another_stack_is_still_applied_and_noted(tmp_path):
    mesh = mesh_1d()
    ring = ring_hardware(mesh, "model")
    x, w = jax.ShapeDtypeStruct((256, 64), jnp.float32), jax.ShapeDtypeStruct((64, 128), jnp.float32)
    problems = slot_problems("allgather_matmul", m=256, k=64, n=128, dtype="float32", axis_size=8)
    other = Software(jax="0.0.1")
    Bundle(overrides=[RoleOverride(model="mine", role="qkv", hardware=ring.identity(), configs=OpConfigs(),
                                   reason="measured", problems=problems, software=other)]).save(tmp_path / "b.json")
    client = Tuned(bundle=tmp_path / "b.json", model="mine")
    assert client.configs("qkv", "allgather_matmul", x, w, mesh=mesh, axis="model") == OpConfigs()
    found = client.resolved_by_role["qkv"]["forward"][1]
    assert found.match == "override" and found.software == other
    (site,) = client.report().applied
    assert any("override measured on another software stack (jax 0.0.1" in n for n in site.notes)

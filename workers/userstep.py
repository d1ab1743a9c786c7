"""A user's own training step: the step spec, and the step measured as written against the drop-in.

The user writes one function, the *step spec*, ``NAME(tuned=None) -> (step, args, mesh)``, or
``(step, args, mesh, context)``:

- with ``tuned=None`` it builds the training step as written (what the user has without cmtune);
- given a config source (a `collective_matmul.Tuned` client, or one of the variants built here,
  each with `Tuned`'s interface: ``allgather_matmul`` / ``matmul_reduce_scatter`` for plain JAX
  code, ``dot_general`` and `collective_matmul.client.flax` for Flax layers) it builds the same step
  through the drop-in;
- ``step`` is the step, jitted or not; ``args`` its arguments (arrays, or
  `jax.ShapeDtypeStruct`s with shardings for discovery and tuning); ``mesh`` the mesh;
- ``context``, where the step must be traced under one (MaxText's ``jax.set_mesh(mesh)`` and
  logical axis rules, a user's ``with mesh:``): a function of no arguments that returns a new
  context manager each time.  Every command lowers, traces and runs the step inside it.

NAME must be deterministic, touch no device at import, and build its mesh from
``jax.devices()``: cmtune sets the devices up first, then imports the spec and calls NAME.  In a
multi-process run every process calls NAME and gets the same arguments, and every process runs
the configs process 0 resolved (`Tuned.pinned`).

`user_step_session` (the step session of `cmtune.workers.stepmeasure` over a `UserStep`) times the
step as written against variants through the drop-in: every variant compiled ahead of time (compile
seconds and memory recorded), checked after one step against the step as written, warmed up, then timed in
interleaved rounds (slowest process per round; paired median and IQR).  The check compares every
output: a leaf that updates an argument (parameters, optimizer state) is held to its dtype's
tolerance of how far the step moved it, plus the rounding of storing it, so an Adam step is
checked as well as SGD; other outputs (the loss, metrics) to the tolerance of their own size.
Donated arguments are fed back from each step's outputs: an argument is paired with the output
of the same structure.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cmtune.tuner.variants import REFERENCE
from cmtune.workers.overrides import SearchBudget, StepPlan
from cmtune.workers.progress import Event, Level, ProgressLine, SitesTraced
from cmtune.workers.stepmeasure import Agreement, Check, StepKind, StepSession
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.wire import MeasurementProtocol, StepCalls

# The share of an updated leaf's elements that may miss the reference's update.  An optimizer that
# normalises the gradient (Adam: g / (|g| + eps)) turns float rounding in a gradient near eps into a
# large part of that element's step: on the GPT example at the demo's size, up to 0.05% of a
# kernel's elements on one process and more than 0.1% over two, while the Adam moments, which carry
# the gradient itself, agree to 6e-7.  A wrong program, or a gradient off by 0.1%, misses nearly all
# of the moments' elements, so the moments (and the loss) catch what the parameters cannot show.
STRAY_SHARE = 1e-2


class SpecError(ValueError):
    """A step spec that cannot be loaded or does not keep the contract; the message says what to fix."""


class NoDropInCall(Exception):
    """A step none of whose calls went through the drop-in: there is nothing to verify."""


@dataclass(frozen=True)
class SpecRef:
    """``path/to/file.py:NAME`` or ``package.module:NAME``."""

    target: str
    name: str

    @classmethod
    def parse(cls, text: str) -> SpecRef:
        target, sep, name = text.strip().rpartition(":")
        if not sep or not target or not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise SpecError(f"{text!r} is not a step spec: give path/to/file.py:NAME or package.module:NAME, where "
                            "NAME(tuned=None) returns (step, args, mesh)")
        return cls(target, name)

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py") or "/" in self.target or "\\" in self.target

    def __str__(self) -> str:
        return f"{self.target}:{self.name}"

    def load(self) -> Callable:
        """Import the spec's module and return NAME (the devices must be set up before)."""
        if self.is_file:
            path = Path(self.target).expanduser().resolve()
            if not path.is_file():
                raise SpecError(f"step spec {self}: no file {self.target}")
            module_name = "cmtune_step_" + re.sub(r"\W", "_", path.stem)
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))  # the spec may import its neighbours
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                raise SpecError(f"step spec {self}: importing {path.name} failed: {type(exc).__name__}: {exc}") from exc
        else:
            try:
                module = importlib.import_module(self.target)
            except Exception as exc:
                raise SpecError(f"step spec {self}: cannot import {self.target}: {type(exc).__name__}: {exc}") from exc
        fn = getattr(module, self.name, None)
        if not callable(fn):
            raise SpecError(f"step spec {self}: {self.target} has no function {self.name!r}")
        return fn


class InContext:
    """A jitted step whose tracing (``lower``, ``trace``, a call) runs inside a spec's context."""

    def __init__(self, jitted, context: Callable[[], object]):
        self.jitted, self.context = jitted, context

    def lower(self, *args, **kwargs):
        with self.context():
            return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with self.context():
            return self.jitted.trace(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        with self.context():
            return self.jitted(*args, **kwargs)


@dataclass
class Built:
    """What NAME returned: the step (jitted, and wrapped in `InContext` where NAME gave a context), its
    arguments and the mesh."""

    step: Callable
    args: tuple
    mesh: object

    @classmethod
    def of(cls, fn: Callable, tuned, *, spec: str = "NAME", devices=None) -> Built:
        """Call ``fn(tuned=tuned)`` (with ``devices=devices`` where NAME takes them and they are given: the devices
        cmtune set up, a TPU slice compiled for ahead of time among them) and check what it returns.

        Raises:
            SpecError: if NAME raises or returns something other than ``(step, args, mesh)``, or is given devices
                it does not take.
        """
        import inspect

        import jax
        from jax.sharding import Mesh

        takes = "devices" in inspect.signature(fn).parameters
        if devices is not None and not takes:
            raise SpecError(f"{spec} takes no 'devices': to compile for a TPU topology, give it a devices argument "
                            "and build its mesh and (abstract) arguments on them (collective_matmul.programs.topology)")
        try:
            out = fn(tuned=tuned, devices=devices) if takes and devices is not None else fn(tuned=tuned)
        except Exception as exc:
            kind = "None" if tuned is None else type(tuned).__name__
            raise SpecError(f"{spec}(tuned={kind}) raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(out, tuple | list) or len(out) not in (3, 4):
            raise SpecError(f"{spec} must return (step, args, mesh) or (step, args, mesh, context), got "
                            + (f"{len(out)} values" if isinstance(out, tuple | list) else type(out).__name__))
        step, args, mesh, context = (*out, None) if len(out) == 3 else out
        if not callable(step):
            raise SpecError(f"{spec} returned a step that is not callable: {type(step).__name__}")
        if not isinstance(args, tuple | list):
            raise SpecError(f"{spec} must return the step's arguments as a tuple, got {type(args).__name__}")
        if not isinstance(mesh, Mesh):
            raise SpecError(f"{spec} must return its jax.sharding.Mesh third, got {type(mesh).__name__}")
        jitted = step if hasattr(step, "lower") else jax.jit(step)
        if context is None:
            return cls(jitted, tuple(args), mesh)
        if not callable(context) or hasattr(context, "__enter__"):
            raise SpecError(f"{spec} returned a context {type(context).__name__}: give a function of no arguments "
                            "that returns a new context manager each time it is called (e.g. lambda: "
                            "jax.set_mesh(mesh)): cmtune enters it for every lowering and run")
        return cls(InContext(jitted, context), tuple(args), mesh)


def signature(tree) -> tuple:
    """A pytree's structure and leaf shapes and dtypes (what pairs an output with an argument)."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


def pair_outputs(args: tuple, outputs) -> dict[int, int]:
    """For each top-level output (a tuple's elements, else the one output), the argument of its structure."""
    outs = outputs if isinstance(outputs, tuple | list) else (outputs,)
    arg_signatures = [signature(a) for a in args]
    free = list(range(len(args)))
    pairs = {}
    for j, out in enumerate(outs):
        sig = signature(out)
        for i in free:
            if arg_signatures[i] == sig:
                pairs[j] = i
                free.remove(i)
                break
    return pairs


# ---- the variants -----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CompiledWith:
    """The step as written, compiled with XLA ``options`` (a variant's config source)."""

    options: Mapping[str, object]


def step_variants(tuned, platform: str | None = None, *, shared: bool = False) -> dict:
    """The variants of a user's step that `cmtune verify --step` times: name -> config source (None: the step as
    written): ``as-written`` (the reference), ``baseline`` (the drop-in with every call at the baseline) and
    ``tuned`` (``tuned`` itself); on a ``platform`` whose XLA has a windowed einsum (TPU, GPU), the step as written
    with it forced ``off`` and ``on`` too (`collective_matmul.planning.xla_options`); where ``tuned`` ``shared`` a
    gather, ``tuned-no-share`` (its configs, every call gathering for itself: `unshared`).  ``--decide`` searches beyond
    them (`cmtune.workers.overrides.search_and_write_overrides`)."""
    from collective_matmul.planning.xla_options import windowed_einsum

    einsum = {f"as-written-windowed-einsum-{s}": CompiledWith(windowed_einsum(platform, s)) for s in ("off", "on")
              if platform and windowed_einsum(platform, s) is not None}
    variants = {REFERENCE: None, **einsum, "baseline": tuned.variant("baseline", lambda role, c: OpConfigs()),
                "tuned": tuned}
    if shared and tuned.share:
        variants["tuned-no-share"] = unshared(tuned)
    return variants


def unshared(tuned, name: str = "tuned-no-share"):
    """A variant of ``tuned`` with its configs whose column calls each gather for themselves (no
    `collective_matmul.ops.share`): the step sharing saves time against."""
    variant = tuned.variant(name, lambda role, configs: configs)
    variant.share = False
    return variant


class UserVerify:
    """A user's part of `cmtune verify --step` (a `cmtune.workers.verify.VerifyTarget`): NAME's step as written
    against the drop-in with tuned configs (and at the baseline, `step_variants`); searched from the configs of each
    role's first call (`user_step_plan`).

    Process 0 looks the configs up (``client()``: a `Tuned` client) while it traces the tuned step, and the others
    replay what it resolved.  `start` raises `SpecError` where NAME breaks the step spec's contract, `follow`
    `NoDropInCall` where no call of the step went through the drop-in.
    """

    found = StepCalls

    def __init__(self, fn: Callable, spec: str, client: Callable[[], object], *, model: str,
                 protocol: MeasurementProtocol, share: bool):
        self.fn, self.spec, self.client, self.model = fn, spec, client, model
        self.protocol, self.share = protocol, share

    def start(self, leader: bool) -> None:
        """The client, the step as written and the session, and NAME built with the client (on every process, in
        the same order: NAME may run SPMD computations of its own); the session compiles it when it measures.

        Raises:
            SpecError: NAME breaks the step spec's contract.
        """
        from collective_matmul.client.tuned import Tuned

        self.tuned = self.client() if leader else Tuned.pinned({})
        self.tuned.share = self.share
        self.reference = Built.of(self.fn, None, spec=self.spec)
        self.session = user_step_session(self.fn, self.reference, model=self.model, spec=self.spec,
                                         protocol=self.protocol)
        self.traced = self.session.kind.built(self.tuned)

    def look_up(self) -> StepCalls:
        """The tuned step traced (tracing only: no device work, nothing the others must join): what it resolved."""
        self.traced.step.trace(*self.reference.args)
        self.sites = self.tuned.report()
        return StepCalls(pins=self.tuned.pins(), per_role=self.tuned.per_role(),
                         axis=next((s.axis for s in self.sites.applied), None), shared=bool(self.sites.groups))

    def shown(self, found: StepCalls) -> list[Event]:
        return [SitesTraced(self.sites)]

    def follow(self, found: StepCalls, leader: bool) -> StepSession:
        """The others pin what process 0 resolved."""
        if not leader:
            self.tuned.pin(found.pins)
        if not found.per_role:
            raise NoDropInCall(f"{self.spec}: no call of the step went through the drop-in: give the Flax layers "
                               "collective_matmul.client.flax.dot_general(tuned, ...) (or call tuned.allgather_matmul "
                               "/ tuned.matmul_reduce_scatter) when NAME gets a tuned client")
        return self.session

    def variants(self, found: StepCalls) -> dict:
        return step_variants(self.tuned, self._platform, shared=found.shared)

    @property
    def _platform(self) -> str:
        return self.reference.mesh.devices.flat[0].platform

    def announce(self, found: StepCalls, variants: Mapping | None,
                 budget: SearchBudget | None) -> list[ProgressLine]:
        import jax

        mesh_text = ",".join(f"{n}={s}" for n, s in self.reference.mesh.shape.items())
        if variants is None:
            return [ProgressLine(f"searching the step of {self.spec} on {mesh_text}, {jax.process_count()} "
                                 f"process(es): up to {max(budget.rounds, 1)} rounds")]
        said = []
        if not any(isinstance(source, CompiledWith) for source in variants.values()):
            said.append(ProgressLine(f"XLA has no windowed einsum on {self._platform}: the step as written is timed "
                                     "once", Level.DETAIL))
        said.append(ProgressLine(f"measuring {self.spec} on {mesh_text}, {jax.process_count()} process(es): "
                                 f"{len(variants)} variants"))
        return said

    def plan(self, found: StepCalls) -> StepPlan:
        return user_step_plan(self.tuned, found.per_role, self.model)

    def sources(self, found: StepCalls) -> Callable[[Mapping], dict]:
        return UserSources(self.tuned)

    def measure_options(self, found: StepCalls) -> dict:
        return {"axis": found.axis}


def user_step_plan(tuned, per_role: Mapping[str, list[OpConfigs]], model: str) -> StepPlan:
    """A user's step as its `Tuned` client traced it (process 0's): each role searched from the configs of its
    first call, as the drop-in resolved them.

    A role seen with several problems is not searched (no one set of configs fits them all): it runs as tuned,
    and is only set back or put on the fixed ring whole, and gets an override only where its configs fit every
    one of its problems.
    """
    uniform = {role: configs[0] for role, configs in per_role.items() if len(configs) == 1}
    others = {role: any(not c.is_baseline for c in configs) for role, configs in per_role.items() if len(configs) > 1}
    sites: dict[str, list] = {}
    for site in tuned.report().applied:
        sites.setdefault(site.role, []).append(site)
    return StepPlan(model=model, hardware=next(iter(sites.values()))[0].hardware, configs=uniform,
                    problems={role: sites[role][0].problems for role in uniform}, others=others,
                    history=tuned.bundle.configs if tuned.bundle is not None else [],
                    bound_problems=[p for site in tuned.report().applied for p in site.problems.values()],
                    calls={role: [site.problems for site in calls] for role, calls in sites.items()},
                    override_problems={role: calls[0].problems for role, calls in sites.items()})


class UserSources:
    """A round's variants of a user's step as config sources: ``tuned`` itself, or a variant of it with the round's
    configs; one source per name (a variant timed again is not built again)."""

    def __init__(self, tuned):
        self.tuned, self.sources = tuned, {}

    def __call__(self, variants: Mapping) -> dict:
        for name, setting in variants.items():
            if name not in self.sources:
                self.sources[name] = None if setting is None else self.tuned if name == "tuned" else \
                    self.tuned.variant(name, lambda role, c, setting=setting: setting.get(role, c))
        return {name: self.sources[name] for name in variants}


# ---- the session ----------------------------------------------------------------------------


def user_step_session(fn: Callable, reference: Built, *, model: str,
                      protocol: MeasurementProtocol = MeasurementProtocol(), spec: str = "NAME") -> StepSession:
    """A user's step and its arguments: a `cmtune.workers.stepmeasure.StepSession` of its `UserStep`, measuring the
    step as written against variants through the drop-in (``measure``: name -> config source, None for the step as
    written; ``axis``: the record's tensor axis).

    Every process of a group must make the same calls in the same order, with the same variants.

    Args:
        fn: the spec's NAME.
        reference: ``Built.of(fn, None)`` (the step as written, with concrete arguments).
        model: the name the step is verified under (its overrides' model).
        protocol: warm-up, repeats and timeout.

    Raises:
        SpecError: if an argument is abstract (verify needs NAME's own initialisation).
    """
    return StepSession(UserStep(fn, reference, model=model, spec=spec), protocol=protocol)


class UserStep(StepKind):
    """A user's step (`StepKind`): NAME rebuilt per config source, checked output by output (`agrees`), donated
    arguments fed back from each step's outputs (`timed_run`)."""

    def __init__(self, fn: Callable, reference: Built, *, model: str, spec: str = "NAME"):
        import jax

        abstract = [leaf for leaf in jax.tree.leaves(reference.args) if not isinstance(leaf, jax.Array)]
        if abstract:
            raise SpecError(f"{spec}(tuned=None) returned abstract arguments ({type(abstract[0]).__name__}): "
                            "verify runs the step, so NAME must build its arguments (its own initialisation: "
                            "parameters, optimizer state, batch)")
        self.fn, self.reference, self.model, self.spec = fn, reference, model, spec
        self.mesh = reference.mesh
        self.args = reference.args
        self._signature = [signature(a) for a in self.args]
        self._built: dict[int, Built] = {}  # id(source) -> NAME(tuned=source), built before measuring

    def built(self, source) -> Built:
        """``NAME(tuned=source)``, checked to take the reference's arguments; kept for `measure` to compile."""
        built = self._built.get(id(source))  # `lowering` takes it out: nothing is kept once compiled
        if built is None:
            built = Built.of(self.fn, source, spec=self.spec)
            if [signature(a) for a in built.args] != self._signature:
                raise SpecError(f"{self.spec}(tuned=...) returned arguments of another structure than "
                                f"{self.spec}(tuned=None): the drop-in must not change the parameters")
            built.args = ()  # the reference's arguments serve every variant
            self._built[id(source)] = built
        return built

    def record_fields(self, *, axis: str | None = None) -> dict:
        """The model, the tensor axis (``axis``, else the mesh's last) and no batch axes."""
        return dict(model=self.model, tensor_axis=axis or self.mesh.axis_names[-1], batch_axes=[])

    def lowering(self, source) -> Callable[[], object]:
        """NAME with the variant's source (the step as written for None or `CompiledWith`)."""
        as_written = source is None or isinstance(source, CompiledWith)
        step = self.reference.step if as_written else self.built(source).step
        self._built.pop(id(source), None)
        return lambda: step.lower(*self.args)

    def compiler_options(self, source) -> Mapping[str, object] | None:
        return source.options if isinstance(source, CompiledWith) else None

    def used(self, source) -> dict[str, OpConfigs]:
        # a `Tuned` client or one of its variants; the step as written uses none
        per_role = source.per_role() if source is not None and not isinstance(source, CompiledWith) else {}
        return {role: configs[0] for role, configs in per_role.items() if configs}

    def check_run(self, executable, expected: Check | None) -> Check:
        """One step from the reference's arguments (a copy of each it donates): ``(arguments, outputs, pairs)``,
        the pairs those of `pair_outputs`; the reference's relative error is 0.

        Raises:
            SpecError: if the step donates an argument and returns nothing of its structure.
        """
        donated = _donated(executable)
        args = _fresh(self.args, donated)
        out = executable(*args)
        pairs = pair_outputs(self.args, out)
        missing = [i for i, d in enumerate(donated) if d and i not in pairs.values()]
        if missing:
            raise SpecError(f"argument {missing[0]} is donated but the step returns nothing of its structure: "
                            "return the updated state so that the next step can take it")
        return Check((args, out, pairs), loss=_loss(out), rel_error=0.0 if expected is None else None)

    def agrees(self, got: Check, expected: Check, reference: str) -> Agreement:
        """Compare every output with the reference's; ``invalid`` if one is off."""
        import jax

        from cmtune.workers.compare import equal, terms
        from cmtune.workers.measure import TOLERANCE

        (_, out, _), (_, want, pairs) = got.value, expected.value
        if signature(out) != signature(want):
            return Agreement(invalid=f"the step returns outputs of another structure than {reference!r}")
        outs = out if isinstance(out, tuple | list) else (out,)
        wants = want if isinstance(want, tuple | list) else (want,)
        worst, worst_name, failed = 0.0, None, None
        for j, (got_out, ref) in enumerate(zip(outs, wants, strict=True)):
            old = self.args[pairs[j]] if j in pairs else None
            paths = jax.tree_util.tree_flatten_with_path(ref)[0]
            got_leaves, old_leaves = jax.tree.leaves(got_out), jax.tree.leaves(old) if old is not None else None
            for index, (path, ref_leaf) in enumerate(paths):
                leaf_name = f"output {j}{jax.tree_util.keystr(path)}"
                got_leaf, ref_leaf = _numeric(got_leaves[index]), _numeric(ref_leaf)
                old_leaf = _numeric(old_leaves[index]) if old_leaves is not None else None
                dtype = str(ref_leaf.dtype)
                if dtype not in TOLERANCE:  # integers, booleans, PRNG keys (step counters, masks): exactly
                    if not equal(got_leaf, ref_leaf):
                        failed = failed or (leaf_name, math.inf, 0.0)
                    continue
                tolerance, eps = TOLERANCE[dtype], _eps(dtype)
                if old_leaf is None:  # the loss, metrics: within the tolerance of their size
                    t = terms(got_leaf, ref_leaf)
                    diff, size = t.diff, t.size
                    error = diff / size if size else (0.0 if diff == 0 else math.inf)
                    ok = math.isfinite(diff) and diff <= tolerance * size + eps * size
                else:  # an updated leaf: each element within the tolerance of how far the step moved it
                    t = terms(got_leaf, ref_leaf, old_leaf, tolerance=tolerance, eps=eps)
                    diff, moved, off = t.diff, t.size, t.off
                    error = diff / moved if moved else (0.0 if diff == 0 else math.inf)
                    ok = math.isfinite(diff) and off <= STRAY_SHARE * math.prod(ref_leaf.shape)
                if not math.isfinite(error):
                    error = math.inf
                if error > worst or worst_name is None:
                    worst, worst_name = error, leaf_name
                if not ok and failed is None:
                    failed = (leaf_name, error, tolerance)
        rel_error = worst if math.isfinite(worst) else None
        if failed is not None:
            leaf_name, error, tolerance = failed
            message = (f"{leaf_name}: off by {error:.3g} of the reference's update or size (tolerance {tolerance:g})"
                       if tolerance else f"{leaf_name}: differs (compared exactly)")
            return Agreement(rel_error, invalid=f"{message} against {reference!r}")
        return Agreement(rel_error)

    def timed_run(self, executable, got: Check) -> Callable[[], object]:
        """One step on the arguments its last step left: each donated one replaced by its output."""
        args, out, pairs = got.value
        donated = _donated(executable)
        state = [_next_args(args, out, pairs, donated)]
        if not any(donated):
            return lambda: executable(*state[0])

        def run():
            out = executable(*state[0])
            state[0] = _next_args(state[0], out, pairs, donated)
            return out

        return run


def _donated(executable) -> list[bool]:
    """Per top-level argument of a compiled step: whether it donates any of its buffers."""
    import jax

    return [any(info.donated for info in jax.tree.leaves(arg_info)) for arg_info in executable.args_info[0]]


def _numeric(leaf):
    """A PRNG key leaf as its key data (compared exactly); any other leaf as it is."""
    import jax

    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def _fresh(args: tuple, donated: list[bool]) -> tuple:
    """``args`` with a copy of each donated one (the step consumes them)."""
    import jax

    return tuple(jax.tree.map(lambda a: jax.device_put(a, a.sharding, may_alias=False), arg) if d else arg
                 for arg, d in zip(args, donated, strict=True))


def _next_args(used: tuple, out, pairs: dict[int, int], donated: list[bool]) -> tuple:
    """The arguments of the next step: each donated one replaced by its output; the others as they were."""
    outs = out if isinstance(out, tuple | list) else (out,)
    nxt = list(used)
    for j, i in pairs.items():
        if donated[i]:
            nxt[i] = outs[j]
    return tuple(nxt)


def _loss(out) -> float | None:
    """The first floating scalar output (the loss, by convention: return it first among the scalars)."""
    import jax
    import jax.numpy as jnp

    for leaf in jax.tree.leaves(out):
        dtype = getattr(leaf, "dtype", None)
        if getattr(leaf, "shape", None) == () and dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            value = float(leaf)
            return value if math.isfinite(value) else None
    return None


def _eps(dtype: str) -> float:
    import jax.numpy as jnp

    return float(jnp.finfo(jnp.dtype(dtype)).eps)

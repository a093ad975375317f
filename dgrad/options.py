"""How a pipeline trains: its options, each checked in one place.

`Options` is the one source of every rule about a pipeline's settings:
`dgrad.Pipeline` builds one from its keyword arguments and the experiment
configs build one from their fields, so both refuse the same settings with the
same message. Each field's help text is where the field is defined; the
command line's `--help` reads it from here.

>>> Options(method="fdg", beta=0.5).shrinks
True
>>> Options(method="fr").weights, Options(method="fr").memory  # a preset of ddg
('current', 'recompute')
>>> Options(method="ddg", beta=0.5)
Traceback (most recent call last):
...
ValueError: beta=0.5 asks for gradient shrinking, which only FDG has; use method=fdg or beta=1.
"""

from __future__ import annotations

import dataclasses
import numbers

from dgrad import checks

METHODS = (
    "bp",
    "ddg",
    "fdg",
    "fr",
    "dgl",
    "gpipe",
    "1f1b",
    "zb",
    "dualpipev",
    "pipedream",
    "2bw",
)
TITLES = {
    "gpipe": "GPipe",
    "pipedream": "PipeDream",
    "2bw": "PipeDream-2BW",
    "zb": "ZB-H1",
    "dualpipev": "DualPipeV",
}


def method_title(method: str, virtual_stages: int = 1) -> str:
    """The method's name as its papers write it (zero-bubble's V schedule with 2 chunks
    a group).

    >>> method_title("fdg"), method_title("gpipe"), method_title("2bw")  # else upper case
    ('FDG', 'GPipe', 'PipeDream-2BW')
    >>> method_title("zb"), method_title("zb", virtual_stages=2)
    ('ZB-H1', 'ZB-V')
    """
    if method == "zb" and virtual_stages == 2:
        return "ZB-V"
    return TITLES.get(method, method.upper())


MICROBATCHED = ("gpipe", "1f1b", "zb", "dualpipev", "2bw")  # split each batch into `microbatches`
SPLIT_BACKWARD = ("zb", "dualpipev")  # cut backwards into B (input) and W (weights)
ALWAYS_CHUNKED = ("dualpipev",)  # only on virtual_stages=2: 2 chunks a device group, in a V
WEIGHT_POLICIES = ("stash", "current")
MEMORY_POLICIES = ("residuals", "dots", "recompute")
PREDICTIONS = ("momentum", "update")  # see dgrad.optim.prediction
STALE_FORWARDS = ("ddg", "fdg", "pipedream")  # a stage forwards at weights its update changes
PLACEMENTS = ("spread", "interleaved", "one_per_device")  # see dgrad.placement


def _help(default, text: str):
    return dataclasses.field(default=default, metadata={"help": text})


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; choose one of: {', '.join(choices)}.")


def check_always_chunked(method: str, virtual_stages: int) -> None:
    """A method that exists only as a V of 2 chunks a device group (`ALWAYS_CHUNKED`)
    needs virtual_stages=2 (`Options` and `dgrad.schedule.check_virtual_stages` ask).

    >>> check_always_chunked("dualpipev", 2), check_always_chunked("zb", 1)
    (None, None)
    >>> check_always_chunked("dualpipev", 1)
    Traceback (most recent call last):
    ...
    ValueError: method=dualpipev puts 2 chunks on each device group, in a V; use ...
    """
    if method in ALWAYS_CHUNKED and virtual_stages != 2:
        raise ValueError(
            f"method={method} puts 2 chunks on each device group, in a V; use "
            f"virtual_stages=2, not {virtual_stages}."
        )


def _known(fields) -> None:
    names = [f.name for f in dataclasses.fields(Options)]
    for name in fields:
        if name not in names:
            raise TypeError(f"unknown option {name!r}; the options are {', '.join(names)}.")


def _integer(name: str, value, minimum: int, fix: str) -> None:
    checks.integer(name, value, minimum, what=f"an integer >= {minimum}", fix=fix)


@dataclasses.dataclass(frozen=True)
class Options:
    """A pipeline's training options, validated on construction (ValueError names the fix).

    >>> Options(memory="dots")
    Options(method='fdg', beta=1.0, weights='stash', memory='dots', fused=False, ...)
    >>> Options(method="ddg", weights="current")
    Traceback (most recent call last):
        ...
    ValueError: weights=current needs memory=recompute: what memory=residuals keeps from ...
    """

    method: str = _help(
        "fdg",
        "training method: bp (backprop), ddg (decoupled backward, Huo et al. 2018), fdg (fully "
        "decoupled, Zhuang et al. 2019), fr (Features Replay, Huo et al. 2018: ddg replaying "
        "on current weights), dgl (decoupled greedy learning, Belilovsky et al. 2020: each "
        "stage trains on its own auxiliary head), gpipe (synchronous, Huang et al. 2019), "
        "1f1b (1F1B-flush, Narayanan et al. 2021: gpipe's numbers in another order; "
        "interleaved with virtual_stages), zb (zero-bubble ZB-H1, Qi et al. 2024: 1F1B with "
        "each backward cut into input and weight gradients, the latter deferred into the "
        "bubble; ZB-V with virtual_stages=2; gpipe's numbers), dualpipev (DualPipeV, the V "
        "half of DeepSeek-V3's DualPipe 2024: ZB-V's placement in its own order, "
        "virtual_stages=2 and microbatches >= 2K; gpipe's numbers), pipedream (asynchronous 1F1B "
        "with weight stashing, Harlap et al. 2019: ddg's numbers), 2bw (PipeDream-2BW, "
        "Narayanan et al. 2021: each gradient one weight version old, steps overlapping with "
        "no flush); dgrad.schedule "
        "states each timetable",
    )
    beta: float = _help(
        1.0,
        "FDG gradient shrinking: stage k's gradient is scaled by beta**(K-1-k) (1 = none)",
    )
    weights: str | None = _help(
        None,
        "weights of the delayed backward: stash (those the batch's forward used) or current "
        "(the stage's weights at backward time; needs memory=recompute; not with pipedream "
        "or 2bw, which stash); unset: stash (fr: current)",
    )
    memory: str | None = _help(
        None,
        "what a stage keeps for its delayed backward: residuals (everything the VJP saves), "
        "dots (only matmul and convolution outputs, the rest recomputed) or recompute (only "
        "the stage input; the forward is recomputed; not with zb, whose weight gradients "
        "read the residuals); unset: residuals (fr: recompute)",
    )
    fused: bool = _help(
        False, "with method=bp: the whole step as one jitted function on one device group"
    )
    predict: str | None = _help(
        None,
        "forward with weights predicted as many updates (tau) ahead as the stage is stale: "
        "momentum (w - tau * predict_lr * the momentum: SpecTrain, for SGD with momentum) or "
        "update (w + tau * the last update: constant velocity, for any optimizer); unset: no "
        "prediction (momentum if predict_lr is set)",
    )
    predict_lr: float | None = _help(
        None, "predict=momentum: the learning rate the momentum is scaled by"
    )
    data_parallel: int = _help(
        1,
        "D, devices per stage: each stage is replicated on D devices and the batch split "
        "between them (-1: every device, D = devices // device groups, K groups of the K*V "
        "chunks with virtual_stages)",
    )
    accumulate: int = _help(
        1,
        "N, steps of gradients summed per update: each stage adds up the gradients of N steps "
        "and steps once, no update in between (with fdg: ADL, Zhuang et al. 2020, N stale "
        "gradients as the authors' code sums them; with gpipe, 1f1b, zb, 2bw: N batches of "
        "microbatches; 2bw's weights one version old are then those before the last step, "
        "unchanged between updates)",
    )
    probe_every: int | None = _help(
        None,
        "every N steps, measure each stage's staleness: cosine and relative difference of the "
        "gradient it applied against the same batch's gradient at the current weights, and "
        "how far its weights moved since that batch's forward; unset: never",
    )
    microbatches: int | None = _help(
        None,
        "M, the microbatches each batch is split into (gpipe, 1f1b, zb, 2bw: each stage "
        "sums their gradients and updates once per batch); unset: 1",
    )
    virtual_stages: int = _help(
        1,
        "V, model chunks per device group, the model cut into K*V stages (1f1b: interleaved "
        "1F1B, Narayanan et al. 2021, chunk j on group j mod K, microbatches a multiple of K; "
        "zb with V=2: ZB-V, Qi et al. 2024, chunk j on group j and back up in a V, 2K-1-j); "
        "1: one stage per group",
    )

    record_sources: bool = _help(
        False,
        "keep with each kept record of a forward's VJP the input, weights and statistics it "
        "was computed from, so that a checkpoint holds those (a batch's input and a copy of "
        "the stage's weights) instead of the VJP, which a restore computes again; costs that "
        "copy per kept batch in memory (the training command sets it)",
    )

    def __post_init__(self):
        _choice("method", self.method, METHODS)
        object.__setattr__(self, "beta", checks.shrinking_factor(self.beta))
        if self.beta != 1.0 and not self.shrinks:
            raise ValueError(
                f"beta={self.beta:g} asks for gradient shrinking, which only FDG has; use "
                "method=fdg or beta=1."
            )
        if self.method in MICROBATCHED:
            microbatches = 1 if self.microbatches is None else self.microbatches
            _integer("microbatches", microbatches, 1, "the batch is split into that many")
            object.__setattr__(self, "microbatches", microbatches)
        elif self.microbatches not in (None, 1):
            raise ValueError(
                f"method={self.method} has no microbatches (only {', '.join(MICROBATCHED)} do); "
                f"leave microbatches unset, not {self.microbatches!r}."
            )
        else:
            object.__setattr__(self, "microbatches", 1)
        _integer("virtual_stages", self.virtual_stages, 1, "use 1 for one stage per group")
        if self.virtual_stages > 1 and self.method not in ("1f1b", "zb", "dualpipev"):
            raise ValueError(
                f"virtual_stages={self.virtual_stages} puts several chunks on each device "
                f"group (1f1b: interleaved 1F1B, zb: ZB-V, dualpipev); use one of those "
                f"methods with it, or virtual_stages=1 with method={self.method}."
            )
        check_always_chunked(self.method, self.virtual_stages)
        if self.method in SPLIT_BACKWARD and self.memory not in (None, "residuals"):
            raise ValueError(
                f"method={self.method} computes each backward's input and weight gradients "
                "in two calls from the forward's kept residuals; leave memory unset or use "
                "memory=residuals."
            )
        if self.method in ("pipedream", "2bw") and self.weights not in (None, "stash"):
            raise ValueError(
                f"method={self.method} takes each gradient at the weights its forward used "
                "(weight stashing); leave weights unset or use weights=stash."
            )
        predict = self.predict or ("momentum" if self.predict_lr is not None else None)
        if predict is not None:
            _choice("predict", predict, PREDICTIONS)
        object.__setattr__(self, "predict", predict)
        if predict == "momentum" and self.predict_lr is None:
            raise ValueError(
                "predict=momentum scales the momentum by predict_lr; set predict_lr to the "
                "optimizer's learning rate."
            )
        if predict == "update" and self.predict_lr is not None:
            raise ValueError(
                "predict=update repeats the last update as it was (its learning rate is in "
                "it); leave predict_lr unset."
            )
        if self.method == "2bw" and predict is not None:
            raise ValueError(
                f"predict={predict} is not supported with method=2bw (its forward uses the "
                "weights of one version before); leave predict and predict_lr unset."
            )
        if predict is not None and self.method not in STALE_FORWARDS:
            raise ValueError(
                f"predict={predict} has nothing to predict under method={self.method}: no stage "
                f"forwards with weights that will have moved on; use one of "
                f"{', '.join(STALE_FORWARDS)}, or leave predict and predict_lr unset."
            )
        presets = {"fr": ("current", "recompute")}
        weights, memory = presets.get(self.method, ("stash", "residuals"))
        if self.method in presets and (self.weights, self.memory) not in (
            (None, None),
            (weights, memory),
        ):
            raise ValueError(
                "method=fr (Features Replay) replays each stage's forward on its current "
                "weights: it is ddg with weights=current and memory=recompute; leave weights "
                "and memory unset."
            )
        if self.method == "dgl" and (self.weights, self.memory) != (None, None):
            raise ValueError(
                "method=dgl applies every gradient at once (no delayed backward keeps "
                "anything); leave weights and memory unset."
            )
        object.__setattr__(self, "weights", self.weights or weights)
        object.__setattr__(self, "memory", self.memory or memory)
        _choice("weights policy", self.weights, WEIGHT_POLICIES)
        _choice("memory policy", self.memory, MEMORY_POLICIES)
        if self.weights == "current" and self.memory != "recompute":
            raise ValueError(
                f"weights=current needs memory=recompute: what memory={self.memory} keeps from "
                "the forward holds the old weights, so the backward would mix stale "
                "activations with live weights; use weights=stash to keep residuals."
            )
        if not isinstance(self.fused, bool):
            raise ValueError(f"fused must be True or False, got {self.fused!r}.")
        if self.fused and self.method != "bp":
            raise ValueError(
                f"fused=True is a form of backprop; it needs method=bp, not {self.method}."
            )
        if self.predict_lr is not None:
            if isinstance(self.predict_lr, bool) or not (
                isinstance(self.predict_lr, numbers.Real) and self.predict_lr > 0
            ):
                raise ValueError(
                    f"predict_lr must be a positive learning rate (predict=momentum's scale of "
                    f"the momentum), got {self.predict_lr!r}."
                )
            object.__setattr__(self, "predict_lr", float(self.predict_lr))
        if self.data_parallel != -1:
            _integer(
                "data_parallel", self.data_parallel, 1, "use -1 to replicate over every device"
            )
        _integer("accumulate", self.accumulate, 1, "use 1 for an update every step")
        if self.accumulate > 1 and self.predict is not None:
            raise ValueError(
                f"predict={self.predict} predicts the weights a number of updates ahead, which "
                "accumulate changes; use one or the other."
            )
        if self.probe_every is not None:
            _integer("probe_every", self.probe_every, 1, "or leave it unset for no probe")

    def replace(self, **fields) -> Options:
        """These options with `fields` replaced, checked again. The fields filled in from
        the method (`weights`, `memory`, `microbatches`, `predict`) keep their filled-in
        values unless given.

        >>> Options(method="ddg").replace(memory="dots").memory
        'dots'
        >>> Options().replace(metod="ddg")
        Traceback (most recent call last):
        ...
        TypeError: unknown option 'metod'; the options are method, beta, weights, ...
        """
        _known(fields)
        return dataclasses.replace(self, **fields) if fields else self

    @classmethod
    def of(cls, options: Options | None = None, **fields) -> Options:
        """`options` with `fields` replaced, or `Options(**fields)` where `options` is None
        (what `dgrad.Pipeline` does with its arguments).

        >>> Options.of(method="fr").memory, Options.of(Options(method="ddg"), beta=1.0).method
        ('recompute', 'ddg')
        """
        if options is None:
            _known(fields)
            return cls(**fields)
        return options.replace(**fields)

    @property
    def shrinks(self) -> bool:
        """Whether the method has gradient shrinking (FDG).

        >>> Options(method="bp").shrinks, Options(method="fdg").shrinks
        (False, True)
        """
        return self.method == "fdg"

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each option's description, by name.

        >>> Options.help()["beta"]
        "FDG gradient shrinking: stage k's gradient is scaled by beta**(K-1-k) (1 = none)"
        """
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}

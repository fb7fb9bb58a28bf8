"""Strict JSON configuration: typed blocks, every problem reported at once.

The blocks are the seed framework's (``trainer``, ``actors``, ``learner``, ``env``, ``policy``,
``algorithm``). Each dataclass below owns its defaults and documents its fields; every numeric field
declares its bounds with ``Annotated[..., Range(...)]`` next to its default (floats must also be finite).
An unknown key, a wrong type, a value out of range or an invalid combination raises
:class:`ConfigError` naming the file and the key.

    cfg = load_config("configs/cartpole_ppo.json", overrides=["trainer.total_steps=50000"])
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Union


class ConfigError(ValueError):
    """A configuration file (or override) is invalid; the message lists every problem."""


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric field, or of each item of a numeric list: ``Annotated[float, Range(gt=0)]``.

    The loader checks them for every dataclass below; a float must also be finite (JSON's ``NaN`` and
    ``Infinity`` parse), whatever its bounds.
    """
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def __str__(self) -> str:
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        if low and self.le is not None:
            return f"in {low[0]}{low[1]}, {self.le}]"
        bounds = ((">=", self.ge), (">", self.gt), ("<=", self.le))
        return " and ".join(f"{op} {b}" for op, b in bounds if b is not None)

    def holds(self, x: float) -> bool:
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le))


class _OutOfRange(str):
    """A problem with a value of the right type: the cross-field rules can still run on the config."""


@dataclass
class VideoConfig:
    """Evaluation videos (``learner/evaluator.py``): the evaluator renders the first `episodes`
    episodes of every `every`-th evaluation, and of the final one, into
    ``RUN_DIR/videos/eval_v<version>_ep<i>.mp4``, and a strip of frames into TensorBoard
    (``eval/video/ep<i>``). Needs PyAV (``pip install -e '.[video]'``) and an env that renders:
    gymnasium envs through ``render_mode="rgb_array"`` (MuJoCo: set ``MUJOCO_GL=egl`` where there is
    no display), ``tandem/Reach-v0`` from its camera image. The evaluator then runs at the lowest
    CPU priority (nice 19) with one software-rasteriser thread."""
    every: Annotated[int, Range(ge=0)] = 0
    """Record every this many evaluations (1: all), plus the final one; 0: no videos."""
    episodes: Annotated[int, Range(ge=1)] = 1
    """Episodes recorded per chosen evaluation (at most trainer.num_eval_episodes)."""
    fps: Annotated[int, Range(ge=1, le=240)] = 30
    """Frames per second of the videos."""
    max_frames: Annotated[int, Range(ge=1)] = 300
    """Frames kept per episode: the first ones (a 1000-step episode need not be 1000 renders)."""
    frame_every: Annotated[int, Range(ge=1)] = 1
    """Render every this many env steps."""
    when: Literal["auto", "live", "end"] = "auto"
    """When a chosen evaluation is rendered. live: during the evaluation, so its video appears mid-run.
    end: the evaluation keeps its actions, and the evaluator replays them with rendering after the final
    evaluation. auto: live where the host has a CPU for every process of the run (learner ranks + actors
    + evaluator), else end (docs/guides/videos_and_env_metrics.md)."""


@dataclass
class TrainerConfig:
    exp_name: str = "tandem"
    """The run's name: a run goes to ``<output_dir>/<exp_name>/<date-time>/`` unless ``--out`` says otherwise."""
    seed: Annotated[int, Range(ge=0, le=2**32 - 1)] = 1
    """Seeds the policy's initialisation (the same in every process), each actor's env and sampling streams
    (derived from it and the actor id) and the evaluations' episodes."""
    total_steps: Annotated[int, Range(ge=1)] = 200_000
    """Env steps to collect (all actors together) before the run ends."""
    buffer_size: Annotated[int, Range(ge=1)] = 128
    """Steps per env per rollout (T): one rollout is [num_envs, buffer_size]."""
    buffer_type: Literal["standard", "async", "vla"] = "async"
    """standard: strict on-policy lock-step. async: asynchronous actors, circular buffer, lag filter
    ("vla", the older spelling of async, is accepted and read as async)."""
    buffer_capacity: Annotated[int, Range(ge=1)] = 8
    """Circular buffer capacity, in rollouts (async mode)."""
    max_policy_lag: Annotated[int, Range(ge=0)] = 4
    """async mode: rollouts older than this many versions are dropped (counted)."""
    lag_policy: Literal["drop", "pace"] = "pace"
    """async mode. pace (default): an actor with enough of its rollouts still unconsumed at the learner
    waits for it before collecting more, so staleness is bounded by admission and no finished rollout is
    thrown away. drop: actors run free and data older than max_policy_lag is dropped, which favours short
    episodes and fast actors (docs/architecture.md)."""
    record: bool = False
    """Store every batch the learner trains on (tensordict memmap under RUN_DIR/record, with its
    order and versions) so that ``launch/replay.py`` can retrain on exactly the same data."""
    rollouts_per_update: Annotated[int, Range(ge=0)] = 0
    """Rollouts consumed by one update; 0 means one per actor (num_actors)."""
    eval_freq: Annotated[int, Range(ge=0)] = 20_000
    """Evaluate (deterministic policy, separate envs) every this many env steps; 0 disables."""
    save_freq: Annotated[int, Range(ge=0)] = 50_000
    """Checkpoint every this many env steps (and always at the end); 0 saves only at the end."""
    num_eval_episodes: Annotated[int, Range(ge=1)] = 10
    """Episodes per evaluation, played side by side in one batched env."""
    eval_device: str = "cpu"
    """Where the evaluator's envs and policy run: ``"cpu"`` (default; it then takes no GPU memory
    from training), or ``"cuda:N"`` for a simulator that lives on a GPU (``tandem/MJWarpHalfCheetah-v0``,
    ManiSkill's ``physx_cuda``), which would otherwise run on its CPU backend, if it has one."""
    eval_seeds: Literal["new", "same"] = "new"
    """Which episodes each evaluation plays. new (default): the k-th evaluation resets its envs with
    seed ``trainer.seed + 1,000,003 + k``, so the curve covers more episodes over a run. same: every
    evaluation plays the episodes of k = 0 (common random numbers), so two points of the curve differ
    only by the policy, not by the episodes drawn: what you want when comparing checkpoints."""
    keep_best: bool = False
    """Write ``RUN_DIR/checkpoints/best.pt`` (the evaluated version's trained tensors and its score) each
    time an evaluation beats every earlier one of the run: success rate where the env reports success,
    else mean return; after ``--resume`` the kept best stays the bar. Pair it with ``eval_seeds: "same"``
    and evaluate it on held-out episodes with ``launch/evaluate.py RUN_DIR --checkpoint best``
    (docs/getting_started.md)."""
    output_dir: str = "outputs"
    """The folder that holds run directories (relative to the working directory)."""
    use_wandb: bool = False
    """Mirror TensorBoard scalars to Weights & Biases (needs the wandb package)."""
    log_interval_s: Annotated[float, Range(gt=0)] = 5.0
    """Seconds between progress lines."""
    video: VideoConfig = field(default_factory=VideoConfig)
    """Evaluation videos (off by default): see :class:`VideoConfig`."""



def weights_at(cfg: "Config") -> str:
    """``actors.weights_at`` resolved: "step" (in-flight weight updates) or "rollout". Standard
    mode is always "rollout" (every version trains on its own data); "auto" is "step" in async mode
    unless ``actors.sync_every`` > 1 asks to hold weights for several rollouts."""
    a = cfg.actors
    if cfg.trainer.buffer_type == "standard":
        return "rollout"
    if a.weights_at == "auto":
        return "step" if a.sync_every == 1 else "rollout"
    return a.weights_at


@dataclass
class ActorsConfig:
    num_actors: Annotated[int, Range(ge=1)] = 2
    """Actor processes (``launch/run_local.sh --actors`` overrides it)."""
    num_envs: Annotated[int, Range(ge=1)] = 8
    """Envs per actor process, stepped in-process as one batched env."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    """Actor i runs on devices[i % len(devices)]."""
    sync_every: Annotated[int, Range(ge=1)] = 1
    """Take new weights at most every this many rollouts (newest version only)."""
    weights_at: Literal["auto", "rollout", "step"] = "auto"
    """When an actor takes new weights (async mode). rollout: only between rollouts, so one version acts
    a whole rollout. step: between env steps too, as soon as a newer version arrives. auto (default): step
    when ``actors.sync_every`` is 1, else rollout. Every step records the version that acted; standard
    mode ignores it (docs/architecture.md)."""
    weights_delay_s: Annotated[float, Range(ge=0)] = 0.0
    """Injected delay on weight delivery: an actor may only load a weights message that arrived at
    least this many seconds ago (a controlled-staleness knob for studies)."""
    weights_lag_versions: Annotated[int, Range(ge=0, le=1000)] = 0
    """Injected staleness counted in versions (async mode, a knob for studies): an actor acts with the
    newest weights it holds that are at least this many versions behind the newest it has received
    (until the learner has published that many, with the first it received). With sync_every 1 the lag
    is constant, about this + 1; sync_every K gives a sawtooth. Every version in between is kept in the
    actor's memory: fine for an MLP, not for a large model (docs/staleness.md)."""
    actions_per_call: Annotated[int, Range(ge=0, le=4096)] = 0
    """Action-chunk policies (``policy.chunk_size`` H > 1): how many of a call's H actions the envs
    execute, one env step each, before the policy is called again; 0: all H. An episode that ends
    mid-chunk stops executing its chunk. A rollout row is one call (docs/metrics.md says which
    counters count calls and which env steps)."""
    torch_threads: Annotated[int, Range(ge=1)] = 1
    """Intra-op threads of each actor process (``torch.set_num_threads``)."""
    nice: Annotated[int, Range(ge=0, le=19)] = 0
    """Scheduling niceness of the actor processes and the inference servers (os.nice). Where they
    and the learner share too few cores and the learner is the bottleneck (async mode, a learner on
    the CPU), a few points let the learner's update run first and the actors take what it leaves."""
    slowdown_s: Annotated[float, Range(ge=0)] = 0.0
    """Extra sleep per env step, to simulate a slow actor (testing and studies)."""
    inference_latency_s: Annotated[float, Range(ge=0)] = 0.0
    """Fixed extra latency per acting policy call on every actor, standing in for a large model
    (a VLA's forward pass can take a second); the actor's CPU stays free meanwhile. With
    inference_latency_per_env_s (b), a call on N envs sleeps this + b x N (actors/emulated_device.py)."""
    inference_latency_per_env_s: Annotated[float, Range(ge=0)] = 0.0
    """The part of the emulated latency that grows with the batch: seconds per env in the call."""
    emulated_devices: list[str] = field(default_factory=list)
    """CPU studies of slow models: actor i infers on the emulated device named
    emulated_devices[i % len]; actors on the same name take turns (a lock across processes on this
    host, under RUN_DIR/devices) for the forward pass and the emulated latency together, as actors
    sharing one GPU do. Empty: every actor has a device of its own. Real CUDA actors need none of it."""
    slow_actor_ids: list[Annotated[int, Range(ge=0)]] = field(default_factory=list)
    """Actors that get `slowdown_s`; empty means all actors."""
    inference: Literal["local", "server"] = "local"
    """Where the acting policy runs. local: every actor holds its own copy (cheap policies). server: one
    inference server per device of actors.devices (servers_per_device of them) holds the only copy and
    acts for all that device's actors in batched forward passes, taking new weights between batches
    (large models; actors/inference.py, docs/guides/inference_server.md)."""
    server_max_batch: Annotated[int, Range(ge=0)] = 0
    """server: the most envs in one forward pass (0: every served actor's envs, num_envs each); at
    least one request's envs (num_envs / server_splits), since a request is never split."""
    server_max_wait_ms: Annotated[float, Range(ge=0, le=10_000)] = 5.0
    """server: how long a request may wait for others to join its batch; a slow or dead actor holds
    the others back by at most this."""
    server_queue: Annotated[int, Range(ge=1, le=100_000)] = 256
    """server: requests waiting for a batch, at most; more are answered "busy" and counted (busy), and
    their actor sends them again 50-100 ms later. At least what a server's actors can have waiting at
    once (its actors x server_splits)."""
    server_splits: Annotated[int, Range(ge=1, le=16)] = 1
    """server: each actor steps its envs in this many parts, each with its own request in flight
    (double-buffered sampling): while the server acts for one part, the actor steps another, so
    the round trip to the server is hidden behind env steps. 1: one request for all envs, then wait.
    actors.num_envs must split evenly, and for GRPO into whole groups."""
    server_transport: Literal["unix", "zmq"] = "unix"
    """server: how actors on the server's host reach it. unix: a Unix stream socket (actors/unix_channel.py;
    fewer thread wake-ups per round trip than ZeroMQ); actors on other hosts, or that cannot open it, use
    the server's ZeroMQ socket, where CURVE applies. zmq: ZeroMQ for all (docs/guides/inference_server.md)."""
    servers_per_device: Annotated[int, Range(ge=1, le=64)] = 1
    """server: inference servers for each distinct entry of actors.devices; an entry's actors are
    dealt out to its servers in turn (its 1st, (k+1)th, ... actor to the first). On Ray, one per node
    for a device name that every node has ("cuda:0"): pin each server and its actors to one node with
    a custom resource per node in launch.ray.server_resources and actor_resources (a server and an
    actor it serves on different nodes is refused). Every server needs at least one actor."""
    rollout_transport: Literal["zmq", "ring"] = "zmq"
    """How rollouts reach the learner. zmq: in the rollout message (any host). ring: each actor
    writes into a ring of preallocated rollout slots that the learner owns on this host (a
    /dev/shm file, or its CUDA memory shared by IPC with a CUDA learner) and the message carries
    only the header (shared/rollout_ring.py). One host only: refused with CURVE, a learner.host
    other than loopback, or several learner ranks."""
    rollout_ring_slots: Annotated[int, Range(ge=1, le=1024)] = 4
    """ring: rollout slots per actor; an actor whose slots all wait for the learner waits too."""
    curve_secret_key: str = ""
    """CURVE: this actor host's secret certificate (its public half must be in the learner's
    curve_authorized_keys)."""
    curve_server_key: str = ""
    """CURVE: the learner's public certificate."""


@dataclass
class LearnerConfig:
    device: str = "cpu"
    """Where the learner's policy and update run: ``cpu`` or ``cuda:N``."""
    host: str = "127.0.0.1"
    """Address the learner binds; 127.0.0.1 keeps a single-host run off the network."""
    advertise_host: str = ""
    """Address actors are told to connect to (endpoints.json, every rank's rollouts address). Empty:
    `host`. Set it where the bind address is not one peers can dial: `host` "0.0.0.0" (every
    interface), a container behind NAT. launch/run_ray.py sets it for each rank to its node's address."""
    rollout_port: Annotated[int, Range(ge=0, le=65535)] = 0
    """TCP port for rollouts (0: pick a free one; endpoints.json tells actors)."""
    weights_port: Annotated[int, Range(ge=0, le=65535)] = 0
    """TCP port for published weights (0: pick a free one; endpoints.json tells actors)."""
    torch_threads: Union[Annotated[int, Range(ge=1)], Literal["auto", "idle"]] = 1
    """Intra-op threads for the update (``torch.set_num_threads``): a number, or auto: the cores this
    process may use less those local actors collect on while it trains (all of them in standard mode),
    or idle: one thread, raised to every usable core for the minibatches taken while the actors have
    nothing to collect. More threads may round the update differently (docs/configuration.md)."""
    critic_thread: Union[bool, Literal["auto", "idle"]] = False
    """PPO with policy.name "actor_critic" on one learner rank: run each minibatch's value loss and its
    backward on a second thread beside the policy loss (the same update, bit for bit, on two cores).
    false (default): off. true: on (an error names why where it cannot apply). auto: on where a CPU
    learner has a core to spare. idle: the thread only for the minibatches taken while the actors have
    nothing to collect (docs/configuration.md)."""
    compile: Literal["auto", "off", "compile", "graph"] = "auto"
    """How the update runs its minibatches (learner/fast_epochs.py). off: the eager loop, one host sync
    per minibatch. compile: no host sync inside an epoch, the loss through torch.compile (may round
    differently). graph: the whole minibatch step captured in a CUDA graph and replayed (uncaptured on
    the CPU; the same weights as off). auto: graph on CUDA for an actor_critic policy, else off; a policy
    that cannot be captured and several learner ranks run off (docs/guides/gpu_and_ddp.md)."""
    recv_hwm: Annotated[int, Range(ge=1)] = 16
    """ZeroMQ receive high-water mark, in messages: bounds memory when actors outrun the learner."""
    devices: list[str] = field(default_factory=list)
    """Several learner ranks, one per device (e.g. ["cuda:0", "cuda:1"]; ["cpu", "cpu"] runs gloo):
    DDP over torch.distributed, started with torchrun by launch/run_local.sh (learner/distributed.py).
    Empty: one learner on `device`."""
    rank_digests: bool = False
    """Each learner rank logs a SHA-256 of its weights after every update (ranks/rank<r>.jsonl)."""
    weights_transport: Literal["zmq", "shm", "cuda_ipc"] = "zmq"
    """How weights reach the actors. zmq: in the weights message (any host). shm: written once per
    version into a shared-memory ring on this host, the message carries only where (large models
    with local actors; see shared/shm_weights.py). cuda_ipc: the same ring in the learner's device
    memory, shared by CUDA IPC, for actors on this host whose devices are all CUDA: a version is
    copied device to device, never through host memory."""
    shm_slots: Annotated[int, Range(ge=1)] = 3
    """shm: versions kept in the ring; an actor more than shm_slots - 1 versions behind re-reads."""
    curve_secret_key: str = ""
    """CURVE: the learner's secret certificate (``launch/make_keys.py``). Set, both learner sockets
    encrypt and admit only the clients in `curve_authorized_keys`. Empty: no CURVE (one host)."""
    curve_authorized_keys: str = ""
    """CURVE: a directory of the public certificates (``*.key``) of the actors allowed to connect."""


@dataclass
class EnvConfig:
    id: str = "CartPole-v1"
    """A gymnasium id, or "tandem/<Name>" for a torch-native batched simulator."""
    cfg: dict = field(default_factory=dict)
    """The env's options: docs/reference/envs.md (a gymnasium id: keywords for gymnasium.make)."""
    device: str = ""
    """Where the actors' envs step ("cpu", "cuda:N"). Empty: on the actor's device (actors.devices);
    gymnasium envs always step on the CPU. "cpu" keeps a torch-native simulator (tandem/...) or
    ManiSkill with a few envs per actor off the GPU while the policy runs there or on an inference
    server, sparing each actor process a CUDA context (docs/guides/inference_server.md)."""


@dataclass
class NetworkConfig:
    hidden_sizes: list[Annotated[int, Range(ge=1)]] = field(default_factory=lambda: [64, 64])
    """Width of each hidden layer, input side first."""
    activation: Literal["tanh", "relu", "elu", "gelu"] = "tanh"
    """Activation after each hidden layer."""


@dataclass
class NetConfig:
    type: Literal["mlp"] = "mlp"
    """Network type (only mlp)."""
    network_cfg: NetworkConfig = field(default_factory=NetworkConfig)
    """Layer widths and activation."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft LoRA) on a pretrained VLA: the wrapped base is frozen; only the adapters,
    ``modules_to_save`` and parameters outside the wrapped base (a value head an adapter adds) train."""
    r: Annotated[int, Range(ge=1)] = 8
    """Rank of each adapter."""
    alpha: Annotated[float, Range(gt=0)] = 16.0
    """The adapters' output is scaled by ``alpha / r``."""
    dropout: Annotated[float, Range(ge=0, le=1)] = 0.0
    """Dropout on the adapters' input; must be below 1 (checked when the model is built: ``Range``
    has no open upper bound)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Names (or dotted name suffixes) of the layers that get adapters, matched as peft does."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules of the base trained in full next to the adapters (e.g. a new head)."""


@dataclass
class VLAConfig:
    """A pretrained model implementing a VLA model interface (``shared/policies/vla.py``)."""
    model_path: str = ""
    """A local checkpoint: a ``.safetensors`` file, a ``torch.save`` state dict (loaded with
    ``weights_only=True``), or a Hugging Face directory (``model.safetensors``, or shards and
    ``model.safetensors.index.json``); for a class with ``from_pretrained``, its directory. Never
    fetched from a hub. Empty: the model keeps the initialisation its class gives it."""
    model_class: str = ""
    """Import path ``package.module.Class`` of an ``nn.Module``: the user's class, or one with
    ``from_pretrained`` (e.g. ``transformers.LlamaForCausalLM``)."""
    model_config: dict = field(default_factory=dict)
    """Keyword arguments for the class (for ``from_pretrained``: for that call, e.g. ``{"dtype": "bfloat16"}``)."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name prefixes to freeze (e.g. ``["vision."]``): not trained."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype; bfloat16 halves memory and weight traffic."""
    autocast: bool = False
    """Run forward passes under ``torch.autocast`` in bfloat16 (where the device supports it)."""
    lora: Optional[LoRAConfig] = None
    """Train low-rank adapters instead of the model's own weights (needs ``pip install -e '.[vla]'``)."""
    tokenizer: str = ""
    """The model's tokenizer for text instructions (``env.cfg.instructions: "text"``): a
    ``tokenizer.json`` or a directory holding one. Empty: ``model_path``'s, when it has one. Only the
    processes that step envs load it (``shared/instructions.py``)."""


@dataclass
class FlowConfig:
    """π0 (transformers' ``PI0ForConditionalGeneration``) fine-tuned with RL (``shared/policies/flow_policy.py``)."""
    model_path: str = ""
    """A local π0 directory (``save_pretrained``'s layout or LeRobot's); Tandem's value and noise heads are
    read from its ``tandem_heads.safetensors`` and start fresh where it has none. Never fetched from a hub."""
    method: Optional[Literal["noise", "sde"]] = None
    """How the denoising chain explores. noise (Flow-Noise): every step Gaussian with a learned std. sde
    (Flow-SDE): one step per call, drawn per row, is stochastic with a fixed std, the others are ODE steps.
    null: noise for PPO, sde for GRPO."""
    num_steps: Optional[Annotated[int, Range(ge=1, le=1000)]] = None
    """Denoising steps K per call. null: the checkpoint's ``num_inference_steps``."""
    noise_std_min: Annotated[float, Range(gt=0)] = 0.08
    """Flow-Noise: the smallest std the noise head can give (a tanh maps its output into [min, max])."""
    noise_std_max: Annotated[float, Range(gt=0)] = 0.16
    """Flow-Noise: the largest std the noise head can give; equal to noise_std_min: a fixed std."""
    noise_level: Annotated[float, Range(gt=0)] = 0.5
    """Flow-SDE: a in sigma_t = a sqrt(t / (1 - t)); the stochastic step's std is sigma_t sqrt(1/K). At
    t = 1 the denominator's t is the next time, 1 - 1/K (Flow-GRPO's convention): the first step's std is a."""
    value_from: Literal["expert", "prefix"] = "expert"
    """What the value head (PPO only) reads. expert: the expert's output mean-pooled over the action
    tokens, from a pass at x = 0, t = 1 (pi0). prefix: the VLM's output mean-pooled over the prompt (pi0.5)."""
    value_hidden_sizes: list[Annotated[int, Range(ge=1)]] = field(default_factory=lambda: [128, 128])
    """Hidden layer widths of the value head (a ReLU MLP)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype of the model (the value and noise heads stay float32)."""
    autocast: bool = False
    """Run forward passes under ``torch.autocast`` in bfloat16 (where the device supports it)."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name prefixes of the model to freeze (e.g. ``["model.vlm."]``): not trained."""
    lora: Optional[LoRAConfig] = None
    """Train low-rank adapters instead of the model's own weights; its target_modules are matched inside
    lora_scope (by default, the expert's q_proj and v_proj). null: no adapters, the model trains whole."""
    lora_scope: Literal["expert", "expert_and_vlm"] = "expert"
    """Where LoRA's target_modules are looked for: the action expert (``model.dit``), or it and the VLM
    (``model.vlm``, vision tower included); layer names such as q_proj exist in both."""
    tokenizer: str = ""
    """The model's tokenizer for text instructions: a ``tokenizer.json`` or a directory holding one.
    Empty: ``model_path``'s, when it has one."""
    instruction_pad_id: Optional[Annotated[int, Range(ge=0)]] = 0
    """Instruction ids equal to this are padding, masked out of attention. null: mask nothing."""


@dataclass
class PolicyConfig:
    name: Literal["actor_critic", "actor_only", "vla", "flow_vla"] = "actor_critic"
    """actor_critic: MLP actor and critic (PPO). actor_only: no critic (GRPO). vla: a pretrained model
    (``vla_config``). flow_vla: a π0 flow-matching model (``flow_config``) acting in chunks."""
    actor: NetConfig = field(default_factory=NetConfig)
    """The actor (policy) network of actor_critic and actor_only."""
    critic: Optional[NetConfig] = field(default_factory=NetConfig)
    """The critic network of actor_critic."""
    normalize_obs: bool = True
    """Running mean/std observation normalisation; its statistics are part of the policy state."""
    clip_obs: Annotated[float, Range(gt=0)] = 10.0
    """Normalised observations are clipped to [-clip_obs, clip_obs]."""
    log_std_init: Annotated[float, Range(ge=-20, le=2)] = 0.0
    """Initial log standard deviation of the Gaussian (Box action spaces); [-20, 2] keeps the std in
    [2e-9, 7.4]."""
    ortho_init: bool = True
    """Orthogonal initialisation, as SB3 and CleanRL: gain sqrt(2) on hidden layers, 0.01 on the
    policy head, 1 on the value head, zero biases. false: torch's default initialisation."""
    vla_config: Optional[VLAConfig] = None
    """Only for name "vla"."""
    flow_config: Optional[FlowConfig] = None
    """Only for name "flow_vla"."""
    chunk_size: Annotated[int, Range(ge=1, le=4096)] = 1
    """Actions returned per policy call (an action chunk, H); the actor executes the first
    ``actors.actions_per_call`` of them. 1: one action per call, as a plain policy. For "vla", H
    actions of A tokens each are decoded in one pass (parallel decoding)."""


@dataclass
class ClippedPGConfig:
    """The keys PPO and GRPO share: the clipped-ratio update and its optimiser."""
    learning_rate: Annotated[float, Range(gt=0)] = 3e-4
    """Adam step size."""
    anneal_lr: bool = False
    """Linearly decay the learning rate to 0 over total_steps."""
    n_epochs: Annotated[int, Range(ge=1)] = 10
    """Passes over each update's batch."""
    batch_size: Annotated[int, Range(ge=1)] = 256
    """Minibatch size, in samples."""
    gamma: Annotated[float, Range(ge=0, le=1)] = 0.99
    """Discount factor."""
    clip_coef: Annotated[float, Range(gt=0)] = 0.2
    """The probability ratio is clipped to [1 - clip_coef, 1 + clip_coef]."""
    ent_coef: Annotated[float, Range(ge=0)] = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: Annotated[float, Range(ge=0)] = 0.5
    """Clip the global gradient norm to this; 0 disables clipping."""
    target_kl: Optional[Annotated[float, Range(gt=0)]] = None
    """Stop the epochs of an update early once approx-KL exceeds this."""
    adam_eps: Annotated[float, Range(gt=0)] = 1e-5
    """Adam's epsilon."""


@dataclass
class PPOConfig(ClippedPGConfig):
    gae_lambda: Annotated[float, Range(ge=0, le=1)] = 0.95
    """GAE's lambda: 0 is the one-step TD error, 1 the Monte Carlo return."""
    clip_vloss: bool = False
    """Clip the value loss around the values the actors computed, with clip_coef (PPO2, CleanRL)."""
    vf_coef: Annotated[float, Range(ge=0)] = 0.5
    """Weight of the value loss."""
    norm_adv: bool = True
    """Normalise advantages to zero mean and unit std in each minibatch."""
    normalize_reward: bool = False
    """Scale rewards by the running std of the discounted return (learner-side)."""
    drift_samples: Annotated[int, Range(ge=0, le=1_000_000)] = 512
    """Rows of each batch the drift ratio (offpolicy/drift_*, docs/metrics.md) is computed on: up to
    twice this many rows go through the policy once more per update. Cheap for an MLP; lower it, or 0
    (off), for a large model."""
    correction: Optional[str] = None
    """Off-policy correction for stale data: none, is, vtrace, appo, ewma, mask, trust, or one
    registered in ``learner/corrections.py``. null: the one recommended for the mode (trust in async
    mode, none in standard mode). What each does and when to use which: docs/corrections.md."""
    rho_bar: Optional[Annotated[float, Range(gt=0)]] = None
    """Truncation of the importance weights. null: the correction's default, 100 for is, ewma and mask,
    1 for vtrace, appo and trust (docs/corrections.md)."""
    c_bar: Annotated[float, Range(gt=0)] = 1.0
    """Truncation of the trace-cutting coefficients c (vtrace, appo)."""
    vtrace_lambda: Optional[Annotated[float, Range(ge=0, le=1)]] = None
    """IMPALA's lambda: c = lambda x min(c_bar, pi/mu); with on-policy data V-trace is then GAE(lambda)
    on the current critic. None: gae_lambda (so that vtrace and none differ only in the correction)."""
    vtrace_advantage: Optional[Literal["gae", "impala"]] = None
    """The policy-gradient advantage of vtrace, appo and trust. gae: GAE(lambda) exactly on on-policy
    data, V-trace's truncated traces off-policy. impala: r + gamma v_{s+1} - V(s) (IMPALA, Sample
    Factory). null: impala for appo, else gae (docs/corrections.md)."""
    appo_rho_weight: bool = True
    """appo: also weight each advantage by min(rho_bar, pi/mu), as Sample Factory does, which damps the
    samples the policy has moved away from; false where the policy changes little per update
    (docs/corrections.md)."""
    ewma_decay: Optional[Annotated[float, Range(ge=0, le=0.999999)]] = None
    """ewma: the proximal weights move as prox <- decay * prox + (1 - decay) * weights after every
    optimiser step. None: decay = age / (1 + age) with age = half the optimiser steps of one update,
    so the proximal policy is on average as old as plain PPO's (Hilton et al. 2021, section 4)."""
    trust_kl: Annotated[float, Range(gt=0)] = 0.1
    """trust: the approximate KL to pi_k one update may move at a mean lag of 1 (divided by the
    batch's mean lag ** trust_lag_power above that); the update stops at the end of the epoch that
    passes it (docs/corrections.md)."""
    trust_lag_power: Annotated[float, Range(ge=0, le=2)] = 0.5
    """trust: the clip and the KL budget are divided by (mean lag) ** trust_lag_power. 0.5 (default): a
    move that adds up like a random walk's; 1: GePPO's scaling; 0: the same budget at every lag
    (docs/corrections.md)."""
    mask_threshold: Annotated[float, Range(gt=1)] = 2.0
    """mask: keep a sample only while 1/threshold <= pi/mu <= threshold (RLinf's
    behave_weight_threshold, default 2)."""
    recompute_values: Optional[bool] = None
    """Recompute V(s) and every bootstrap value with the current critic instead of taking the acting
    critic's. null (default): when the batch holds samples of an older version (async mode); true:
    always; false: never (docs/corrections.md)."""

    advantages_every: Optional[Literal["update", "epoch"]] = None
    """When the corrections compute advantages and value targets. update: once, at the start of the
    update. epoch: again before every later epoch, from the live critic and policy (one forward pass
    over the batch per epoch). null (default): epoch for vtrace, appo and trust on a batch that holds
    stale samples, else update. No effect with correction none and recompute_values false
    (docs/corrections.md)."""


@dataclass
class GRPOConfig(ClippedPGConfig):
    """Group-relative policy optimisation: critic-free, advantages relative to a group of envs
    that start from identical states (see ``learner/grpo.py``)."""
    n_epochs: Annotated[int, Range(ge=1)] = 4
    group_size: Annotated[int, Range(ge=2)] = 8
    """Envs per group; actors.num_envs must be a multiple of it. A group of one has zero advantages."""
    kl_coef: Annotated[float, Range(ge=0)] = 0.0
    """Weight of the KL penalty to the frozen reference (initial) policy: 0 from scratch, ~0.02 to fine-tune."""
    clip_coef_high: Optional[Annotated[float, Range(gt=0)]] = None
    """The upper clip: the ratio is clipped to [1 - clip_coef, 1 + clip_coef_high] (DAPO's
    "clip-higher", Yu et al. 2025; SimpleVLA-RL uses 0.28 with clip_coef 0.2). A wider upper bound
    lets a rarely sampled action that succeeded gain more probability in one update, against the
    collapse onto what the policy already does most. None: clip_coef (symmetric)."""
    eps: Annotated[float, Range(gt=0)] = 1e-8
    """Added to the within-group standard deviation (0 would divide by zero when a group's returns tie)."""
    scale_by_std: bool = True
    """Divide by the within-group standard deviation (the original GRPO). ``false`` keeps the
    mean-centred returns (Dr. GRPO, Liu et al. 2025): a group whose returns differ only by noise
    then gets small advantages instead of unit-scale ones; better when rewards are dense."""
    baseline: Literal["step", "episode"] = "step"
    """What an env's return is compared with (see ``learner/grpo.py``). ``"step"``: its return-to-go
    against those of its group's envs still running at the same step. ``"episode"``: its whole-episode
    return against its group's, one advantage for all its steps (outcome-level GRPO; the choice for a
    0/1 success reward). ``"episode"`` needs ``truncate_at_first_done``."""
    loss_mean: Literal["step", "episode"] = "step"
    """How the loss averages. ``"step"``: every step weighs the same (DAPO's token-level mean).
    ``"episode"``: every env's episode weighs the same whatever its length (the original GRPO's
    per-sequence mean). With ``baseline: "episode"`` and a 0/1 success reward, failures run longer
    than successes, so a step-level mean pushes down on sampled actions more than it pushes up and
    entropy climbs; ``"episode"`` balances the two. ``"episode"`` needs ``truncate_at_first_done``."""
    reset_every_rollout: bool = True
    """Reset every env at the start of each rollout (a new seed per group and per rollout)."""
    truncate_at_first_done: bool = True
    """An env contributes only up to its first episode end in the rollout."""
    dynamic_sampling: bool = False
    """Dynamic sampling (DAPO; SimpleVLA-RL): leave out of the loss every group whose members' outcomes
    are all the same (zero advantage), and take more rollouts until an update holds as many groups that
    differ as rollouts_per_update rollouts would. Needs trainer.buffer_type "async"
    (docs/guides/inference_server.md)."""
    dynamic_sampling_min_accuracy: Annotated[float, Range(ge=0, le=1)] = 0.0
    """With dynamic sampling, the lower end of a band on a group's success rate: a group is kept when
    min < its rate < max instead of when its outcomes differ (SimpleVLA-RL: 0.1 and 0.9). A member
    succeeded when its return up to its first episode end is positive. 0 and 1 (the defaults) keep the
    rule above, for any reward (docs/guides/inference_server.md)."""
    dynamic_sampling_max_accuracy: Annotated[float, Range(ge=0, le=1)] = 1.0
    """The upper end of that band (see ``dynamic_sampling_min_accuracy``)."""


GRPO_EPISODE_NEEDS_TRUNCATION = {
    "baseline": "an env's later episodes start from states its group does not share",
    "loss_mean": "without it every env has all the rollout's steps, and nothing to weigh by"}
"""Why each GRPO option's "episode" value needs ``truncate_at_first_done`` (config check and learner)."""

ALGORITHM_CONFIGS = {"ppo": PPOConfig, "grpo": GRPOConfig}


@dataclass
class RayLaunchConfig:
    """``launch/run_ray.py``: one placement group holds a bundle per learner rank, per actor and per
    inference server; each bundle's Ray actor owns one Tandem process (docs/guides/multi_node.md)."""
    learner_resources: list[dict] = field(default_factory=lambda: [{"CPU": 1}])
    """Ray resources of each learner rank's bundle: one entry for every rank, or one per rank (rank r
    takes entry r). GPUs may be fractional ({"CPU": 1, "GPU": 0.5}); a custom resource pins a role
    to the nodes started with it (``ray start --resources '{"node_a": 1}'``, then {"node_a": 0.01})."""
    actor_resources: list[dict] = field(default_factory=lambda: [{"CPU": 1}])
    """Ray resources of each actor's bundle: actor i takes entry i % len (same forms as above)."""
    server_resources: list[dict] = field(default_factory=lambda: [{"CPU": 1}])
    """actors.inference "server": Ray resources of each inference server's bundle (server s takes
    entry s % len; same forms as above). A server holds the model (give it the GPU; its actors then
    need none) and must be placed on the node of every actor it serves: use strategy STRICT_PACK, or
    pin servers and actors to a node with a custom resource."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement group strategy: PACK fills few nodes, SPREAD spreads over many (best effort);
    STRICT_* fail rather than bend."""
    ready_timeout_s: Annotated[float, Range(gt=0)] = 300.0
    """Seconds to wait for the cluster to have room for every bundle before the launcher gives up."""


@dataclass
class LaunchConfig:
    """How a launcher places the processes; only launch/run_ray.py reads it (``launch.ray``)."""
    ray: RayLaunchConfig = field(default_factory=RayLaunchConfig)


@dataclass
class AlgorithmConfig:
    name: Literal["ppo", "grpo"] = "ppo"
    """The algorithm; it chooses the schema of ``cfg``."""
    cfg: Union[PPOConfig, GRPOConfig] = field(default_factory=PPOConfig)
    """PPOConfig for "ppo", GRPOConfig for "grpo" (chosen by `name`)."""


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    source: str = field(default="<dict>", compare=False)
    """Where this config came from (for error messages); not a config key."""

    @property
    def rollouts_per_update(self) -> int:
        return self.trainer.rollouts_per_update or self.actors.num_actors

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


# ----------------------------------------------------------------------------- parsing

def type_words(tp: Any, literal: Callable[[Any], str] = repr, bounds: bool = False) -> str:
    """An annotation in words (``string``, ``'a' | 'b'``, ``list of integer``); `literal` writes a
    Literal's values, `bounds` adds an ``Annotated`` Range (``integer in [1, 512]``)."""
    if typing.get_origin(tp) is Annotated:
        base, *extra = typing.get_args(tp)
        ranges = [str(x) for x in extra if isinstance(x, Range)] if bounds else []
        return type_words(base, literal, bounds) + (f" {' and '.join(ranges)}" if ranges else "")
    if typing.get_origin(tp) is Literal:
        return " | ".join(literal(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(type_words(a, literal, bounds) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {type_words(typing.get_args(tp)[0], literal, bounds)}"
    return {type(None): "null", dict: "object", float: "number", int: "integer", bool: "boolean",
            str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    """Check `value` against the annotation `tp`; return the converted value or append an error."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        inner, bounds = typing.get_args(tp)
        n_errors = len(errors)
        value = _convert(value, inner, path, errors)
        if len(errors) == n_errors and not bounds.holds(value):
            errors.append(_OutOfRange(f"{path}: must be {bounds}, got {value}"))
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return tp()
        return _build(tp, value, path, errors)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(value, inner[0], path, errors)
        # Several alternatives (e.g. an integer or "auto"): the first that takes the value wins; one
        # of the right type but out of range reports its range, anything else the alternatives.
        tried = []
        for alt in inner:
            alt_errors: list[str] = []
            converted = _convert(value, alt, path, alt_errors)
            if not alt_errors:
                return converted
            tried.append(alt_errors)
        in_range = [e for e in tried if all(isinstance(x, _OutOfRange) for x in e)]
        errors.extend(in_range[0] if in_range else [f"{path}: expected {type_words(tp)}, got {value!r}"])
        return value
    if origin is Literal:
        if value not in typing.get_args(tp):
            errors.append(f"{path}: expected one of {type_words(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: expected {type_words(tp)}, got {type(value).__name__}")
            return []
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: expected a number, got {value!r}")
            return 0.0
        try:
            value = float(value)
        except OverflowError:  # an integer beyond the float range
            value = math.inf
        if not math.isfinite(value):
            errors.append(_OutOfRange(f"{path}: must be a finite number, got {value}"))
        return value
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            errors.append(f"{path}: expected an integer, got {value!r}")
            return 0
        return int(value)
    if tp in (bool, str, dict):
        if not isinstance(value, tp):
            errors.append(f"{path}: expected {type_words(tp)}, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")  # a bug in this module


def _build(cls: type, raw: dict, path: str, errors: list[str]) -> Any:
    hints = dict(typing.get_type_hints(cls, include_extras=True))
    if cls is AlgorithmConfig:  # the cfg block's schema depends on the algorithm's name
        hints["cfg"] = ALGORITHM_CONFIGS.get(raw.get("name"), PPOConfig)
        if "cfg" not in raw:
            raw = {**raw, "cfg": {}}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            known = ", ".join(sorted(fields))
            errors.append(f"{where}: unknown key (known keys here: {known})")
            continue
        kwargs[key] = _convert(value, hints[key], where, errors)
    return cls(**kwargs)


# Rules added by the package that owns a field's vocabulary, since shared/ imports neither actors/ nor
# learner/ (tests/test_layering.py). Each takes the built config, may fill the fields it owns that were
# left null, and returns its problems. learner/corrections.py adds algorithm.cfg.correction's (the
# recommended correction for the mode; the registry's names), so every process that trains checks it.
OWNER_RULES: list[Callable[[Config], list[str]]] = []


def add_rule(rule: Callable[[Config], list[str]]) -> Callable[[Config], list[str]]:
    """Add `rule` to :data:`OWNER_RULES` (once; usable as a decorator)."""
    if rule not in OWNER_RULES:
        OWNER_RULES.append(rule)
    return rule


def _check(cfg: Config) -> list[str]:
    """Cross-field rules, one function per concern; every violated rule is reported. Single fields'
    bounds are their `Range`s; the rules also run when a value is out of its Range (a group_size of 0
    is reported there)."""
    return [e for rule in (_check_algorithm, _check_devices, _check_transport, _check_learner_threads,
                           _check_server, _check_trainer, _check_policy) for e in rule(cfg)]


def _check_algorithm(cfg: Config) -> list[str]:
    """algorithm.cfg against the rest: GRPO's groups, dynamic sampling, the correction, the batch."""
    t, a, alg, p = cfg.trainer, cfg.actors, cfg.algorithm.cfg, cfg.policy
    errors: list[str] = []
    grpo = isinstance(alg, GRPOConfig)
    if grpo and alg.group_size > 0 and a.num_envs % alg.group_size:
        errors.append(f"actors.num_envs: {a.num_envs} is not a multiple of algorithm.cfg.group_size "
                      f"({alg.group_size}); GRPO splits each actor's envs into groups")
    why = GRPO_EPISODE_NEEDS_TRUNCATION
    for key in ("baseline", "loss_mean"):
        if grpo and getattr(alg, key) == "episode" and not alg.truncate_at_first_done:
            errors.append(f"algorithm.cfg.{key}: \"episode\" needs algorithm.cfg.truncate_at_first_done true "
                          f"({why[key]})")
    if grpo and p.name == "actor_critic":
        errors.append(f"policy.name: GRPO is critic-free: use \"actor_only\" (got {p.name!r}; "
                      f"algorithm.name is \"grpo\")")
    band = (getattr(alg, "dynamic_sampling_min_accuracy", 0.0), getattr(alg, "dynamic_sampling_max_accuracy", 1.0))
    if band != (0.0, 1.0):
        if not getattr(alg, "dynamic_sampling", False):
            errors.append(f"algorithm.cfg.dynamic_sampling_min_accuracy / _max_accuracy {band}: a band for dynamic "
                          f"sampling, which is off (algorithm.cfg.dynamic_sampling: false)")
        if band[0] >= band[1]:
            errors.append(f"algorithm.cfg.dynamic_sampling_min_accuracy {band[0]} must be below "
                          f"dynamic_sampling_max_accuracy {band[1]}: no group could be kept")
    if getattr(alg, "dynamic_sampling", False) and t.buffer_type == "standard":
        errors.append("algorithm.cfg.dynamic_sampling needs trainer.buffer_type \"async\": it takes more rollouts "
                      "than rollouts_per_update when groups are dropped, and standard mode has no more of a "
                      "version than that")
    samples = cfg.rollouts_per_update * a.num_envs * t.buffer_size
    if alg.batch_size > samples:
        errors.append(f"algorithm.cfg.batch_size: {alg.batch_size} is larger than one update's data "
                      f"(rollouts_per_update x actors.num_envs x trainer.buffer_size = {samples})")
    return errors


def _check_devices(cfg: Config) -> list[str]:
    """Device names, and several learner ranks (learner.devices)."""
    t, a, le, alg = cfg.trainer, cfg.actors, cfg.learner, cfg.algorithm.cfg
    errors: list[str] = []
    if not a.devices:
        errors.append("actors.devices: must name at least one device, e.g. [\"cpu\"]")
    for i, name in enumerate(a.emulated_devices):
        if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", name):
            errors.append(f"actors.emulated_devices[{i}]: {name!r} is not a device name (1-64 letters, digits, "
                          f"'_', '.' or '-'; it names a lock file)")
    for i, dev in enumerate([*a.devices, le.device, t.eval_device]):
        if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", dev):
            where = (f"actors.devices[{i}]" if i < len(a.devices)
                     else "learner.device" if i == len(a.devices) else "trainer.eval_device")
            errors.append(f"{where}: unknown device {dev!r} (use 'cpu', 'cuda' or 'cuda:N')")
    if cfg.env.device and not re.fullmatch(r"cpu|mps|cuda(:\d+)?", cfg.env.device):
        errors.append(f"env.device: unknown device {cfg.env.device!r} (use 'cpu', 'cuda' or 'cuda:N'; "
                      "empty: the actor's device)")
    for i, dev in enumerate(le.devices):
        if not re.fullmatch(r"cpu|cuda(:\d+)?", dev):
            errors.append(f"learner.devices[{i}]: unknown device {dev!r} (use 'cpu' or 'cuda:N')")
    world = len(le.devices)
    if world > 1:
        if len({d.split(":")[0] for d in le.devices}) > 1:
            errors.append(f"learner.devices: mixes CPU and CUDA ranks ({le.devices}); use one kind")
        if a.num_actors % world:
            errors.append(f"actors.num_actors: {a.num_actors} is not a multiple of the {world} learner ranks "
                          f"(learner.devices); actor i sends to rank i % {world}")
        if isinstance(alg, GRPOConfig):
            errors.append("learner.devices: several learner ranks train PPO only (GRPO's unmasked sample count "
                          "differs per rank, so the ranks' DDP steps would not line up)")
        if t.record:
            errors.append("trainer.record: recording is for one learner rank (learner.devices has several)")
        if any(d == "cuda" for d in le.devices):
            errors.append(f"learner.devices: name each GPU ('cuda:0', 'cuda:1'), got {le.devices}")
        if le.rollout_port + world - 1 > 65535:
            errors.append(f"learner.rollout_port: {le.rollout_port} + {world - 1} (rank r binds rollout_port + r) "
                          f"is past the last port, 65535")
        if le.rollout_port and le.weights_port and le.rollout_port <= le.weights_port < le.rollout_port + world:
            errors.append(f"learner.weights_port: {le.weights_port} collides with the ranks' rollout ports "
                          f"{le.rollout_port}..{le.rollout_port + world - 1} (rank r binds rollout_port + r)")
        if cfg.rollouts_per_update % world:
            errors.append(f"trainer.rollouts_per_update: {cfg.rollouts_per_update} is not a multiple of the "
                          f"{world} learner ranks (learner.devices); each rank trains on its share")
    return errors


def _check_transport(cfg: Config) -> list[str]:
    """How weights and rollouts travel: rings, staleness knobs, CURVE, Ray's resources."""
    t, a, le = cfg.trainer, cfg.actors, cfg.learner
    errors: list[str] = []
    ring_weights = le.weights_transport in ("shm", "cuda_ipc")
    if ring_weights and a.weights_delay_s > 0:
        errors.append(f"actors.weights_delay_s: a delay cannot be combined with learner.weights_transport "
                      f"\"{le.weights_transport}\" (the ring would be rewritten before a delayed version is loaded)")
    if le.weights_transport == "cuda_ipc":
        not_cuda = [f"{key} {dev!r}" for key, dev in ([("learner.device", le.device), ("trainer.eval_device", t.eval_device)]
                                                    + [(f"actors.devices[{i}]", d) for i, d in enumerate(a.devices)])
                    if not str(dev).startswith("cuda")]
        if not_cuda:
            errors.append(f"learner.weights_transport \"cuda_ipc\": the learner, the evaluator and every actor must be "
                          f"on CUDA (a CPU process would open a CUDA context only to copy the weights out), but "
                          f"{', '.join(not_cuda)}; use \"shm\"")
    if a.weights_lag_versions:
        if t.buffer_type == "standard":
            errors.append(f"actors.weights_lag_versions: {a.weights_lag_versions} needs trainer.buffer_type \"async\" "
                          f"(standard mode trains each version on its own data only)")
        if a.weights_delay_s > 0:
            errors.append("actors.weights_lag_versions / actors.weights_delay_s: choose one staleness knob")
        if ring_weights:
            errors.append(f"actors.weights_lag_versions: cannot be combined with learner.weights_transport "
                          f"\"{le.weights_transport}\" (the ring keeps only learner.shm_slots versions)")
    if a.rollout_transport == "ring":
        # the ring lives in this host's memory: refuse it wherever an actor could be on another host
        why = [w for w, bad in (
            (f"learner.host is {le.host!r} (actors may connect from other hosts; use 127.0.0.1)",
             le.host not in ("127.0.0.1", "localhost", "::1")),
            (f"learner.advertise_host is {le.advertise_host!r} (actors on other hosts)",
             le.advertise_host not in ("", "127.0.0.1", "localhost", "::1")),
            ("CURVE is on (learner.curve_secret_key / actors.curve_secret_key: actors on other hosts)",
             bool(le.curve_secret_key or a.curve_secret_key)),
            (f"learner.devices has {len(le.devices)} ranks (one ring owner only)", len(le.devices) > 1)) if bad]
        if why:
            errors.append("actors.rollout_transport: \"ring\" needs every actor on the learner's host and one "
                          "learner rank, but " + "; and ".join(why) + "; use \"zmq\"")
    errors += _check_ray_resources(cfg.launch.ray, len(le.devices) or 1)
    if bool(le.curve_secret_key) != bool(le.curve_authorized_keys):
        errors.append("learner.curve_secret_key / learner.curve_authorized_keys: set both (CURVE on) or neither")
    if bool(a.curve_secret_key) != bool(a.curve_server_key):
        errors.append("actors.curve_secret_key / actors.curve_server_key: set both (CURVE on) or neither")
    if le.curve_secret_key and not a.curve_secret_key:
        errors.append("actors.curve_secret_key: the learner requires CURVE (learner.curve_secret_key is set), "
                      "so actors need keys too")
    if a.weights_at == "step" and t.buffer_type == "async" and a.sync_every > 1:
        errors.append(f"actors.weights_at: \"step\" takes every new version at once, and actors.sync_every "
                      f"{a.sync_every} asks to hold weights for several rollouts: choose one")
    return errors


def _check_learner_threads(cfg: Config) -> list[str]:
    """learner.critic_thread, torch_threads and compile together."""
    le, alg, p = cfg.learner, cfg.algorithm.cfg, cfg.policy
    errors: list[str] = []
    world = len(le.devices)
    if le.critic_thread is True:
        why = ("algorithm.name is \"grpo\" (no critic)" if isinstance(alg, GRPOConfig)
               else f"policy.name is {p.name!r}, not \"actor_critic\"" if p.name != "actor_critic"
               else f"learner.devices has {world} ranks (DDP reduces the gradients inside one backward)"
               if world > 1 else None)
        if why:
            errors.append(f"learner.critic_thread: true needs PPO with policy.name \"actor_critic\" on one "
                          f"learner rank, but {why}; use false, \"auto\" or \"idle\"")
    if le.torch_threads == "idle" and le.critic_thread is not False:
        errors.append(f"learner.torch_threads: \"idle\" and learner.critic_thread {le.critic_thread!r} would "
                      f"both take the idle cores: set critic_thread false, or torch_threads to a number")
    if le.compile in ("compile", "graph") and le.critic_thread is True:
        errors.append(f"learner.compile {le.compile!r} and learner.critic_thread true: the critic thread is "
                      f"the eager loop's (compile \"off\"); choose one")
    return errors


def _check_server(cfg: Config) -> list[str]:
    """actors.inference "server" and its knobs."""
    t, a, alg = cfg.trainer, cfg.actors, cfg.algorithm.cfg
    errors: list[str] = []
    grpo = isinstance(alg, GRPOConfig)
    if a.inference == "server":
        if t.buffer_type == "async" and a.weights_at == "rollout":
            errors.append("actors.weights_at \"rollout\" and actors.inference \"server\": the server holds one copy "
                          "for all its actors and takes each new version between batches, so a rollout may be "
                          "acted by several versions (each step records its own); use \"auto\" or \"step\"")
        if a.sync_every > 1:
            errors.append(f"actors.sync_every {a.sync_every} and actors.inference \"server\": the server takes every "
                          f"new version; choose one")
        if a.num_envs % a.server_splits:
            errors.append(f"actors.server_splits: {a.num_envs} envs (actors.num_envs) do not split into "
                          f"{a.server_splits} equal parts")
        elif grpo and alg.group_size > 0 and (a.num_envs // a.server_splits) % alg.group_size:
            errors.append(f"actors.server_splits: parts of {a.num_envs // a.server_splits} envs split GRPO groups of "
                          f"{alg.group_size} (algorithm.cfg.group_size); a group must be in one part")
        elif 0 < a.server_max_batch < a.num_envs // a.server_splits:
            errors.append(f"actors.server_max_batch {a.server_max_batch}: one request holds "
                          f"{a.num_envs // a.server_splits} envs (actors.num_envs / actors.server_splits) and is "
                          f"never split; use 0 or at least that")
        per_device = dict.fromkeys(a.devices, 0)       # an entry no actor falls on would get idle servers
        for i in range(a.num_actors):
            per_device[a.devices[i % len(a.devices)]] += 1
        short = {d: n for d, n in per_device.items() if n < a.servers_per_device}
        if short:
            errors.append(f"actors.servers_per_device {a.servers_per_device}: devices {sorted(short)} have only "
                          f"{sorted(set(short.values()))} actors (actors.num_actors {a.num_actors} over "
                          f"actors.devices); every server needs one")
        most = max(-(-n // a.servers_per_device) for n in per_device.values())   # actors of the busiest server
        if a.server_queue < most * a.server_splits:
            errors.append(f"actors.server_queue {a.server_queue}: a server's {most} actors can have "
                          f"{most * a.server_splits} requests waiting at once (actors.server_splits "
                          f"{a.server_splits} each); use at least that, or every round some would be sent back "
                          f"as busy")
        if a.emulated_devices:
            errors.append("actors.emulated_devices and actors.inference \"server\": each server is its device's "
                          "only user (its latency is actors.inference_latency_s + _per_env_s x batch); leave it empty")
    elif a.servers_per_device > 1:
        errors.append(f"actors.servers_per_device {a.servers_per_device} needs actors.inference \"server\"")
    elif a.server_splits > 1:
        errors.append(f"actors.server_splits {a.server_splits} needs actors.inference \"server\" (a local copy "
                      f"answers at once: there is no round trip to hide)")
    return errors


def _check_trainer(cfg: Config) -> list[str]:
    """The buffer against the actors, and the trainer's switches."""
    t, a = cfg.trainer, cfg.actors
    errors: list[str] = []
    bad_ids = [i for i in a.slow_actor_ids if i >= a.num_actors]  # negative ids are out of Range
    if bad_ids:
        errors.append(f"actors.slow_actor_ids: ids {bad_ids} are not in 0..{a.num_actors - 1}")
    if t.buffer_type == "standard" and cfg.rollouts_per_update > a.num_actors:
        errors.append(f"trainer.rollouts_per_update: {t.rollouts_per_update} is more than actors.num_actors "
                      f"({a.num_actors}); in standard mode each actor sends one rollout per version, so the "
                      f"learner would wait forever")
    if t.buffer_type == "async" and t.buffer_capacity < cfg.rollouts_per_update:
        errors.append(f"trainer.buffer_capacity: {t.buffer_capacity} cannot hold one update's "
                      f"{cfg.rollouts_per_update} rollouts (trainer.rollouts_per_update, default num_actors)")
    if t.use_wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            errors.append("trainer.use_wandb: true needs the wandb package (pip install wandb)")
    return errors


def _check_policy(cfg: Config) -> list[str]:
    """policy against the algorithm."""
    p = cfg.policy
    errors: list[str] = []
    if cfg.algorithm.name == "ppo" and (p.name == "actor_only" or (p.name == "actor_critic" and p.critic is None)):
        errors.append(f"policy.name: PPO needs a critic: use \"actor_critic\" with a policy.critic block, a "
                      f"\"vla\" model with a value head, or \"flow_vla\" (got name {p.name!r}"
                      f"{', critic null' if p.critic is None else ''})")
    if p.name == "vla" and (p.vla_config is None or not p.vla_config.model_class):
        errors.append("policy.vla_config.model_class: policy.name \"vla\" needs the model's import path "
                      "(package.module.Class)")
    if p.name != "vla" and p.vla_config is not None:
        errors.append(f"policy.vla_config: only used with policy.name \"vla\" (got {p.name!r})")
    errors += _check_flow_policy(p)
    n = cfg.actors.actions_per_call
    if p.chunk_size > 1 and n > p.chunk_size:
        errors.append(f"actors.actions_per_call: {n} is more than the {p.chunk_size} actions a call returns "
                      f"(policy.chunk_size)")
    return errors


def _check_flow_policy(p: PolicyConfig) -> list[str]:
    """policy.flow_config against policy.name."""
    f, errors = p.flow_config, []
    if p.name != "flow_vla":
        if f is not None:
            errors.append(f"policy.flow_config: only used with policy.name \"flow_vla\" (got {p.name!r})")
        return errors
    if f is None or not f.model_path:
        errors.append("policy.flow_config.model_path: policy.name \"flow_vla\" needs a local π0 checkpoint "
                      "directory (PI0ForConditionalGeneration.save_pretrained's, or LeRobot's)")
    if f is not None and f.noise_std_min > f.noise_std_max:
        errors.append(f"policy.flow_config.noise_std_min {f.noise_std_min} is above noise_std_max {f.noise_std_max}")
    if p.chunk_size != 1:
        errors.append(f"policy.chunk_size: {p.chunk_size}, but a \"flow_vla\" policy's chunk is its checkpoint's "
                      f"chunk_size (config.json); leave policy.chunk_size out")
    return errors


def _check_ray_resources(r: RayLaunchConfig, world: int) -> list[str]:
    """launch.ray: resource maps of names to non-negative numbers, one learner entry or one per rank."""
    errors = []
    for key in ("learner_resources", "actor_resources"):
        entries = getattr(r, key)
        if not entries:
            errors.append(f"launch.ray.{key}: give at least one resource map, e.g. [{{\"CPU\": 1}}]")
        for i, res in enumerate(entries):
            bad = [k for k, v in res.items() if isinstance(v, bool) or not isinstance(v, (int, float))
                   or not math.isfinite(v) or v < 0]
            if bad:
                errors.append(f"launch.ray.{key}[{i}]: {bad} must be non-negative numbers (Ray resource amounts)")
    if len(r.learner_resources) not in (1, world):
        errors.append(f"launch.ray.learner_resources: {len(r.learner_resources)} entries for {world} learner "
                      f"rank(s) (learner.devices); give one for every rank or one per rank")
    return errors


def _apply_override(raw: dict, override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE, e.g. trainer.total_steps=50000")
    try:
        value = json.loads(text)
    except ValueError:  # JSONDecodeError, or an integer past Python's 4300-digit limit
        value = text  # bare strings: --set env.id=Pendulum-v1
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {override!r}: {part!r} is not a block")
    node[parts[-1]] = value


def config_from_dict(raw: dict, source: str = "<dict>", overrides: list[str] = ()) -> Config:
    """Validate a raw dict into a :class:`Config`.

    Raises:
        ConfigError: listing every unknown key, wrong type and broken cross-field rule,
            each prefixed with `source` and the dotted key.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    try:
        raw = json.loads(json.dumps(raw))  # deep copy; the caller's dict is never mutated
    except (TypeError, ValueError) as e:  # a value JSON cannot hold (object, set, circular reference)
        raise ConfigError(f"{source}: not JSON data: {e}") from None
    for o in overrides:
        _apply_override(raw, o)
    errors: list[str] = []
    cfg = _build(Config, raw, "", errors)
    if isinstance(cfg.trainer, TrainerConfig) and cfg.trainer.buffer_type == "vla":
        cfg.trainer.buffer_type = "async"   # the older spelling: one name from here on
    if all(isinstance(e, _OutOfRange) for e in errors):  # every value has its type: the cross-field rules apply
        for rule in OWNER_RULES:
            errors += rule(cfg)
        errors += _check(cfg)
    if errors:
        lines = "\n".join(f"  {source}: {e}" for e in errors)
        raise ConfigError(f"invalid config ({len(errors)} problem{'s' * (len(errors) > 1)}):\n{lines}")
    cfg.source = source
    return cfg


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Load and validate a JSON config file; `overrides` are ``"block.key=json"`` strings."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not UTF-8 text
        raise ConfigError(f"{path}: cannot read the config file: {e}") from None
    except ValueError as e:  # an integer past Python's 4300-digit limit
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    return config_from_dict(raw, source=str(path), overrides=overrides)


def save_config(cfg: Config, path: str | Path) -> None:
    """`cfg` as JSON at `path`, through a temp file and a rename (a full disk leaves no half file)."""
    from shared.files import write_json_atomic
    write_json_atomic(path, cfg.to_dict(), indent=2)

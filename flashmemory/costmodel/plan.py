"""A node plan: can one decode node serve `conc` requests of `ctx` tokens with FlashMemory (and a disk tier)?
A PROJECTION from the cost model; nothing here is measured.

Per request of `ctx` tokens (KMAX resident pages, Path-I at >= 1M), each resource gives the number of requests it
holds or keeps up with; the smallest one below the planned concurrency is what runs out first:
- HBM token pool (per GPU): sglang's sizing (`pools`): full tokens over ctx + --num-reserved-decode-tokens per
  request. With CREDIT_C4=1 the launch lowers --mem-fraction-static by FlashMemory's reserve, sized as the plugin
  sizes it for TGT_CONC = the planned concurrency (`anchors.fm_reserve_bytes`).
- SWA pool (per GPU): ratio mode, --swa-full-tokens-ratio "auto" = the smallest ratio that holds the live windows
  of every request the full pool admits (at most the planned concurrency) and one newcomer's tail + output
  reservation (`pools.auto_swa_ratio`; launch_decode.sh passes it with TGT_CONC set to that count), or a given ratio
  (sglang's DeepSeek-V4 default 0.1).
- max-running: the decode server's --max-running-requests (a launch flag, not hardware).
- host DRAM (node): usable = host_ram x host_fraction. Without disks it holds every rank's mirror of the history
  (`RequestBytes.host` x GPUs). With the disk tier it holds each request's landing window (`WINDOW_PAGES` pages
  per rank); the rest is the page cache over the history.
- disk capacity (node): drives x TB x disk_fraction over the history x copies (one per rank, or node-shared).
- disk bandwidth: per Level-1 cycle (tau steps) the read-ahead of the cache's misses plus the write-behind of
  admissions' pages must land within tau x step (`disk.disk_point`); the cap is the largest concurrency for which
  they do. The cache hit rate is the share of the history the cache holds, unless given.
Bytes moved are per decode token of one request: H2D recall and D2H write-back per GPU link
(`RequestBytes.pcie_step`), disk -> host read-ahead and host -> disk write-behind per node.
Tok/s is `disk.disk_point`'s: the calibrated step, lengthened when the disk does not keep up.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from flashmemory.costmodel.admission import fm_reserve_bytes, sized
from flashmemory.costmodel.anchors import fit, launch_node
from flashmemory.costmodel.bytes import PolicyKnobs, RequestBytes, flashmemory_bytes
from flashmemory.costmodel.disk import DiskKnobs, DiskPoint, disk_point
from flashmemory.costmodel.flops import FlashShape, RetrieverShape, n_chunks
from flashmemory.costmodel.pools import (
    PoolSizes,
    admitted,
    auto_swa_ratio,
    full_need,
    swa_need,
)
from flashmemory.costmodel.presets import H20_LAUNCH, Preset

WINDOW_PAGES = 3  # landing-window floor per request per rank: SGLANG_PATHP_DECODE_MAX_CONC x 3 page slots
UPSTREAM_SHARE = 96 / 1024  # upstream's KMAX 96 pages of a 256K request's 1,024 pages
SCAN_LIMIT = 8192  # most requests the disk-bandwidth scan tries (a cap of SCAN_LIMIT means "at least")
MODELS = ("dsv4-flash",)  # the geometries the cost model has (FlashShape); DSv4-Pro is not in it


@dataclass(frozen=True)
class FmSettings:
    """FlashMemory's launch settings that change the plan. kmax None: ceil(budget_share x pages of ctx)
    (SGLANG_PATHP_PAGE_KMAX_RATIO); credit_c4: SGLANG_PD_CREDIT_OFFLOADED_C4; tau: SGLANG_RETRIEVER_INTERVAL;
    turnover: share of the resident set replaced per cycle (1.0 = worst case); hit_rate None: the cache's share of
    the history; path_i None: on at >= 1M tokens."""

    kmax: int | None = None
    budget_share: float = UPSTREAM_SHARE
    credit_c4: bool = True
    tau: int = 64
    turnover: float = 1.0
    hit_rate: float | None = None
    path_i: bool | None = None

    def __post_init__(self) -> None:
        if self.kmax is not None and self.kmax < 1:
            raise ValueError(f"FmSettings.kmax must be >= 1, got {self.kmax}")
        if not 0 < self.budget_share <= 1:
            raise ValueError(f"FmSettings.budget_share must lie in (0, 1], got {self.budget_share}")
        if self.tau < 1:
            raise ValueError(f"FmSettings.tau must be >= 1, got {self.tau}")
        if not 0 <= self.turnover <= 1:
            raise ValueError(f"FmSettings.turnover must lie in [0, 1], got {self.turnover}")
        if self.hit_rate is not None and not 0 <= self.hit_rate <= 1:
            raise ValueError(f"FmSettings.hit_rate must lie in [0, 1], got {self.hit_rate}")


@dataclass(frozen=True)
class Resource:
    """One resource at the planned concurrency: `cap` requests of ctx it holds (or keeps up with); `need` and
    `have` in `unit` at the planned concurrency (need > have when cap < conc)."""

    name: str
    cap: int
    need: float
    have: float
    unit: str


@dataclass(frozen=True)
class Tier:
    """One storage tier: requests it holds, bytes one request takes there, and bytes it moves per decode token of
    one request (name -> bytes)."""

    name: str
    fits: int
    bytes_per_request: float
    moves: dict[str, float]


@dataclass(frozen=True)
class Plan:
    """The projected plan. `point`: the cost model at the planned concurrency as if admitted; `admitted`: the most
    requests every resource allows, and `tok_s_admitted` there (0 when none)."""

    node: Preset
    disk: DiskKnobs | None
    pools: PoolSizes
    ctx: int
    conc: int
    kmax: int
    path_i: bool
    fm: FmSettings
    req: RequestBytes
    hit_rate: float
    resources: tuple[Resource, ...]
    tiers: tuple[Tier, ...]
    point: DiskPoint
    admitted: int
    tok_s_admitted: float

    @property
    def fits(self) -> bool:
        return all(r.cap >= self.conc for r in self.resources)

    @property
    def first_out(self) -> Resource | None:
        """The resource with the fewest requests among those that hold fewer than `conc` (None when all fit)."""
        short = [r for r in self.resources if r.cap < self.conc]
        return min(short, key=lambda r: r.cap) if short else None


def h20_node() -> Preset:
    """This repo's 8xH20 decode launch (FP8 experts, sglang's default memory fraction and SWA ratio) with the
    fitted host fraction and per-step overhead."""
    return launch_node(fit(), H20_LAUNCH)


def pages_of(ctx: int, s: FlashShape = FlashShape(), r: RetrieverShape = RetrieverShape()) -> int:
    return math.ceil(n_chunks(ctx, s) / r.page_chunks)


def resolve_kmax(ctx: int, fm: FmSettings) -> int:
    """KMAX as the server derives it: the explicit value, else ceil(budget_share x pages), at least 1."""
    if fm.kmax is not None:
        return fm.kmax
    return max(1, math.ceil(fm.budget_share * pages_of(ctx)))


def hbm_pools(
    node: Preset, ctx: int, conc: int, kmax: int, credit_c4: bool, path_i: bool, swa_ratio: float | str, max_new: int
) -> tuple[PoolSizes, Resource, Resource]:
    """One GPU's pools at the planned launch and the requests they hold: the full token pool (ctx + reserved decode
    tokens each) and the SWA pool (`pools.swa_need`). `swa_ratio` 'auto' = `smallest_swa_ratio` for `conc`."""
    sv = dataclasses.replace(node.serving, credit_c4=credit_c4)
    if credit_c4:
        per_rank = math.ceil(conc / sv.dp)  # each attention rank's reserve rows are its own requests
        sv = dataclasses.replace(sv, reserve_bytes=fm_reserve_bytes(per_rank, kmax, sv.running_per_rank, path_i))
    if swa_ratio == "auto":  # the smallest ratio for what the full pool holds, at most `conc`

        def full_holds(r: float) -> int:
            s = dataclasses.replace(sv, swa_ratio=r)
            return sized(node, s).full_tokens // full_need(1, ctx, s) * s.dp

        ratio = auto_swa_ratio(full_holds, conc, ctx, sv)[0]
    else:
        ratio = float(swa_ratio)
    sv = dataclasses.replace(sv, swa_ratio=ratio)
    pools = sized(node, sv)
    if pools.mem_fraction <= 0 or pools.available <= 0:
        raise ValueError(
            f"no HBM left for KV: --mem-fraction-static {pools.mem_fraction:.3f} (after the reserve) x "
            f"{node.hw.hbm_gb:g} GB leaves {pools.available / 1e9:,.1f} GB after the weights; raise --hbm-gb or "
            "--gpus, or lower --concurrency / --kmax (the reserve)"
        )
    token_cap = pools.full_tokens // full_need(1, ctx, sv)
    swa_cap = admitted(dataclasses.replace(pools, full_tokens=10**15), ctx, sv, max_new=max_new)[0]
    per_rank = math.ceil(conc / sv.dp)
    return (
        pools,
        Resource(
            "HBM token pool (per GPU)", token_cap * sv.dp, full_need(per_rank, ctx, sv), pools.full_tokens, "tokens"
        ),
        Resource(
            f"HBM SWA pool (per GPU, ratio {ratio:g})",
            swa_cap * sv.dp,
            swa_need(per_rank, ctx, max_new),
            pools.swa_tokens,
            "tokens",
        ),
    )


def _hit(usable: float, conc: int, window: float, history: float, fm: FmSettings) -> float:
    if fm.hit_rate is not None:
        return fm.hit_rate
    cache = max(0.0, usable - conc * window)
    return min(1.0, cache / (conc * history))


def _point(
    node: Preset,
    disk: DiskKnobs | None,
    ctx: int,
    kmax: int,
    conc: int,
    knobs: PolicyKnobs,
    r: RetrieverShape,
    hit: float,
    pool_cap: int,
    output_tokens: int,
) -> DiskPoint:
    dk = (
        dataclasses.replace(disk, hit_rate=hit)
        if disk is not None
        else DiskKnobs(hit_rate=1.0, output_tokens=output_tokens)
    )  # no disk: nothing read or written
    return disk_point(ctx, kmax, conc, node.hw, dk, knobs, r=r, pool_cap=pool_cap)


def plan(
    node: Preset,
    disk: DiskKnobs | None,
    ctx: int,
    conc: int,
    fm: FmSettings = FmSettings(),
    output_tokens: int = 8192,
    swa_ratio: float | str = "auto",
) -> Plan:
    """The plan for `conc` requests of `ctx` tokens on `node` (calibrated preset) with `disk` (None: no disk tier).
    `output_tokens` (decode tokens per request) sets how often admissions write their history behind and the
    output reservation of the SWA pool; `swa_ratio`: --swa-full-tokens-ratio or 'auto' (see `hbm_pools`)."""
    if ctx < 4 or conc < 1:
        raise ValueError(f"plan: ctx {ctx} must be >= 4 and conc {conc} >= 1")
    if output_tokens < 1:
        raise ValueError(f"plan: output_tokens must be >= 1, got {output_tokens}")
    s, r = FlashShape(), dataclasses.replace(RetrieverShape(), interval=fm.tau)
    kmax = resolve_kmax(ctx, fm)
    if kmax > pages_of(ctx):
        raise ValueError(f"plan: KMAX {kmax} exceeds the {pages_of(ctx)} pages of a {ctx}-token request")
    path_i = fm.path_i if fm.path_i is not None else ctx >= 1048576
    knobs = PolicyKnobs(path_i=path_i, turnover=fm.turnover)
    req = flashmemory_bytes(ctx, kmax, knobs, s, r)
    if disk is not None:
        disk = dataclasses.replace(disk, output_tokens=output_tokens)
    hw = node.hw
    gpus = hw.n_gpus // node.serving.dp  # the ranks that hold one request's KV (its attention group)
    usable = hw.host_ram_gb * 1e9 * hw.host_fraction
    page = req.host / pages_of(ctx)
    window = WINDOW_PAGES * page * gpus if disk is not None else 0.0
    copies = (disk.copies or gpus) if disk is not None else gpus
    history = req.host * copies

    pools, pool, swa = hbm_pools(node, ctx, conc, kmax, fm.credit_c4, path_i, swa_ratio, output_tokens)
    res = [
        pool,
        swa,
        Resource(
            "max-running (--max-running-requests)", node.serving.max_running, conc, node.serving.max_running, "requests"
        ),
    ]
    host_per = window if disk is not None else req.host * gpus
    host = "host DRAM (node, landing windows)" if disk is not None else "host DRAM (node, full mirrors)"
    res.append(Resource(host, int(usable // host_per), conc * host_per, usable, "B"))

    def at(c: int) -> DiskPoint:
        cap = min(pool.cap, swa.cap)
        return _point(node, disk, ctx, kmax, c, knobs, r, _hit(usable, c, window, history, fm), cap, output_tokens)

    pt = at(conc)
    if disk is not None:
        res.append(
            Resource("disk capacity (node)", int(disk.disk_bytes // history), conc * history, disk.disk_bytes, "B")
        )
        bw = 0  # the disk time per cycle grows with the concurrency (more reads, a colder cache): stop at a miss
        for c in range(1, SCAN_LIMIT + 1):
            if at(c).window_share > 1.0:
                break
            bw = c
        res.append(
            Resource(
                "disk bandwidth (reads + writes within tau x step)", bw, pt.disk_ms_cycle, pt.window_ms, "ms per cycle"
            )
        )
    n_adm = min(x.cap for x in res)
    tok_adm = at(n_adm).tok_s if n_adm >= 1 else 0.0
    hit = pt.hit_rate
    recall = req.recall_cycle / fm.tau
    tiers = [
        Tier("HBM (per GPU)", min(pool.cap, swa.cap), req.device, {"HBM read per GPU": req.hbm_read_step}),
        Tier(
            "host DRAM (node)",
            res[3].cap,
            host_per,
            {"H2D recall per GPU link": recall, "D2H write-back per GPU link": req.pcie_step - recall},
        ),
    ]
    if disk is not None:
        tiers.append(
            Tier(
                "disk (node)",
                res[4].cap,
                history,
                {
                    "disk -> host read-ahead": recall * copies * (1.0 - hit),
                    "host -> disk write-behind": history * (1.0 - hit) / output_tokens,
                },
            )
        )
    return Plan(node, disk, pools, ctx, conc, kmax, path_i, fm, req, hit, tuple(res), tuple(tiers), pt, n_adm, tok_adm)

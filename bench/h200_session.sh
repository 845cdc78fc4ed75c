#!/usr/bin/env bash
# The H200 runs of issues 4 and 5, one phase per device call (each fits the 10-minute limit).
#
# Prepare here, once (both folders are git-ignored through .git/info/exclude and carried):
#   mkdir -p .whl .benchdata && cp ../shared/bench/texts_en.tsv ../shared/breeze/tokenizer/tokenizer.json .benchdata/
#   git rev-parse --short HEAD > .benchdata/COMMIT     # recorded in the results
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection soxr==1.1.0
# Then per phase: run(command="bash bench/h200_session.sh PHASE", carry=[".whl", ".benchdata"])
# PHASE: tests | fused | depth-pdl | first-packet-pdl |
#        chain P1 P2...  | decode | decode-micro | decode-bench | tune | profile | stages |
#        ablation-eager | ablation-a|b|c|d[@I/N] | sweep | sweep+ablation | latency |
#        latency-nocap | predictor | predictor-edf | capacity-closed | capacity-open | capacity-tests | capacity-256 |
#        burst | slack | voice | te-tokens | admit | path | tune-decode | trace | prefill |
#        prefill-bench | before-after | gc | tests-changed |
#        codec-precision | codec-upsampler | codec-state | codec-layout | big-batch | steady |
#        census-256 | margin |
#        depth-gemm | timeline |
#        decode-attention | capacity-ab (carry .prevtree too) |
#        room (issue 34: carry=[".roombundle"] alone, built by `make room-bundle`; see the phase) |
#        scaleout (issue 36: kind nvidia-h200-x4, carry=[".roombundle"]; SCALE_K, SCALE_DISPATCH)
# An ablation phase with @I/N runs shard I of N of its requests (bench --shard).
# Several GPUs (kind nvidia-h200-x4): "parallel GPU=PHASE[+PHASE...] ..." runs each list on its own
# GPU at once, e.g. parallel 0=ablation-a@1/2 1=ablation-a@2/2 2=tests+ablation-d; the results
# come back as $OUT/results.tgz.
set -euo pipefail
phase=${1:?phase}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -z "${BREEZERT_SITE_READY:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  # .whl-train/ (the teacher, 14 MB) and .whl-asr/ (the in-run scorer's pocketsphinx, 5.7 MB;
  # both from make train-wheels) travel only with the voice phase
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(ls .whl-train/*.whl .whl-asr/*.whl 2>/dev/null)
fi
if [ -z "${BREEZERT_SITE_READY:-}" ] && [ -f .roombundle/site.tar.xz ]; then
  # make room-bundle: the room benchmark's packages (pydantic and soxr among them)
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    .roombundle/site.tar.xz /tmp/site
fi
export PYTHONPATH=/tmp/site:runtime:bench:training:. PYTHONUNBUFFERED=1 BREEZERT_SITE_READY=1
# A wheel missing from .whl/ fails here in seconds, not minutes into a phase (soxr did, 2 Dec)
[ -n "${BREEZERT_IMPORTS_OK:-}" ] || python3 -c "import breezert.cli, breezert.runtime_setup" \
  || { echo "breezert does not import here: add the missing wheel to .whl/" >&2; exit 3; }
export BREEZERT_IMPORTS_OK=1
shard=""
case "$phase" in *@*) shard=${phase#*@}; phase=${phase%@*} ;; esac
case "$phase" in
  ablation-?) ;;
  *) [ -z "$shard" ] || { echo "phase $phase takes no @I/N shard" >&2; exit 2; } ;;
esac
commit=$(cat .benchdata/COMMIT 2>/dev/null || cat .roombundle/COMMIT 2>/dev/null || echo unknown)
export BREEZERT_GIT_COMMIT=$commit  # every result records it (breezert_bench.provenance)
# The room phases' server and tokenizer out of .roombundle (make room-bundle), into folder $1, and
# their imports checked: a package the image lacks or has too old fails here in seconds, naming it.
room_prepare() {
  mkdir -p "$1"
  unxz() { python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2"; }
  [ -x "$1/livekit-server" ] || { unxz .roombundle/livekit-server.xz "$1/livekit-server" && chmod +x "$1/livekit-server"; }
  [ -f "$1/tokenizer-trimmed.json" ] || unxz .roombundle/tokenizer.json.xz "$1/tokenizer-trimmed.json"
  python3 -c "import livekit.rtc, livekit.api, livekit.agents, breezert_agent, breezert.server.app; print('room imports ok')"
}
# The common bench command; each phase adds its own arguments.
bench=(python3 -m breezert_bench --config configs/h200-latency.toml
       --texts .benchdata/texts_en.tsv --tokenizer .benchdata/tokenizer.json --git-commit "$commit")
case "$phase" in
  tests)   # graph replay == eager for every bucket, batch invariance, full-size streaming
    timeout 540 python3 -m pytest tests/gpu -q -s -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -20 ;;
  fused)   # GPU tests (incl. the fused Triton depth layers), fused stage timings, fused census
    timeout 240 python3 -m pytest tests/gpu -q -s -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15 || true
    timeout 200 python3 bench/stage_timing.py --batches 1,16,64 --modes fused \
      --out "$out/h200-stage-timing-fused.json" 2>&1 | grep -v Warn | tail -8
    timeout 100 python3 bench/profile_stages.py --batch 16 --fused --compile --top 20 2>&1 \
      | tee "$out/profile-fused.log" | grep -A21 DEPTH ;;
  parallel)
    shift
    pids=()
    for spec in "$@"; do
      gpu=${spec%%=*}; phases=${spec#*=}
      mkdir -p "$out/g$gpu"
      # each list runs in its own session, so the deadline below can stop all of it (the
      # phases' own `timeout`s put their commands in process groups of their own)
      CUDA_VISIBLE_DEVICES=$gpu OUT="$out/g$gpu" OMP_NUM_THREADS=8 \
        setsid bash "$0" chain ${phases//+/ } > "$out/g$gpu/log.txt" 2>&1 &
      pids+=($!)
    done
    deadline=$((SECONDS + ${PARALLEL_S:-570}))  # so the results below always come back
    while [ "$SECONDS" -lt "$deadline" ] && kill -0 "${pids[@]}" 2>/dev/null; do sleep 2; done
    for pid in "${pids[@]}"; do pkill -TERM -s "$pid" 2>/dev/null || true; done
    sleep 2
    for pid in "${pids[@]}"; do pkill -KILL -s "$pid" 2>/dev/null || true; done
    wait || true
    for spec in "$@"; do
      echo "== GPU $spec"; grep -v Warn "$out/g${spec%%=*}/log.txt" | tail -30 || true
    done
    (cd "$out" && tar czf results.tgz g* && rm -rf g*) ;;
  chain) shift; for p in "$@"; do bash "$0" "$p" || echo "phase $p failed: $?"; done ;;
  voice)  # issues 19 and 35, one call: teacher data -> codec -> codes -> LM -> export, codec
    # recipe 2 (multi-scale log-mel, discriminator from the mel plateau, 4 active codebooks) and
    # the in-run WER (12 CPU processes score the codec / voice every 2 training minutes on 20
    # held-out corpus sentences; wer_curve.jsonl; the rule stops a stage at its goal and ends
    # the call when the recipe stalls: docs/voice-training.md). The state comes in from
    # $VOICE_STATE (default .voicestate/, ignored: `bash bench/voice_state.sh restore` fills it
    # from the commit voice-state.ref names; carry it) and comes back as $OUT/state.NNN
    # (+ state.json): `bash bench/voice_state.sh store FILES_AT "message"` commits them to git
    # history and names them in voice-state.ref, out of the tree every other call carries.
    # Carry .whl, .whl-train and .whl-asr (make train-wheels) and
    # .traindata (corpus.json.gz, built here); a call that trains only the LM needs no
    # .whl-train, unless it synthesises fresh hours (--lm-fresh-hours). VOICE_ARGS: more
    # pipeline flags, e.g. "--wer-label r2-lr2 --codec-batch-size 32". VOICE_MINUTES: the call's minutes (9.3), less where the session's device budget is
    # short.
    mkdir -p /tmp/voice/teacher
    [ ! -f .traindata/corpus.json.gz ] || cp .traindata/corpus.json.gz /tmp/voice/teacher/
    python3 -c "import pocketsphinx" 2>/dev/null \
      || echo "no pocketsphinx here (.whl-asr not carried): nothing will be scored" >&2
    # expandable segments: an H100's LM step once failed on 18.8 GiB reserved between blocks
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    timeout 580 python3 -m breezert_train.pipeline --work /tmp/voice --minutes-total "${VOICE_MINUTES:-9.3}" \
      --out "$out" --carry-in "${VOICE_STATE:-.voicestate}" ${VOICE_ARGS:-} 2>&1 \
      | tee /tmp/voice/pipeline.log | grep -v '^\[wer\]' | tail -30
    grep '^\[wer\]' /tmp/voice/pipeline.log | tail -12 || true
    cp /tmp/voice/pipeline.log "$out/" ;;
  decode)  # the fused backbone DECODE step: GPU tests, step times, census, then 300 requests
    # at 16 and 32 concurrent with it on (compare with h200-predictor-20261129.json.gz)
    timeout 200 python3 -m pytest tests/gpu/test_gpu_fused_decode.py -q -p no:cacheprovider 2>&1 \
      | tee "$out/gpu_tests.log" | tail -5 || true
    bash "$0" decode-micro; bash "$0" decode-bench ;;
  decode-micro)  # fused DECODE step times and kernel census
    timeout 150 python3 bench/stage_timing.py --batches 1,16,64 --modes fused-decode \
      --out "$out/h200-stage-timing-fused-decode.json" 2>&1 | grep -v Warn | tail -6
    timeout 60 python3 bench/profile_stages.py --batch 16 --fused --fused-decode --compile 2>&1 \
      | grep -A6 DECODE ;;
  decode-bench)  # 300 requests at 16 and 32 concurrent with the fused DECODE step on
    timeout 250 "${bench[@]}" --concurrency 16,32 --num-requests 300 --warmup 16 \
      --variants fused-decode --run-budget 80 \
      --variant 'fused-decode=progressive-graphs;graph.fused_decode=true;scheduler.use_predictor=true' \
      --out "$out/h200-fused-decode.json" 2>&1 | grep '^\[bench' ;;
  tune)    # the fused kernels' GPU tests (TMA tiles, row buckets), then launch shapes of the fused
    # depth layers tuned at ${TUNE_ROWS} rows (bench/tune_fused_depth.py), each from its bucket
    timeout 150 python3 -m pytest tests/gpu/test_gpu_fused_depth.py tests/gpu/test_gpu_fused_decode.py \
      -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests_fused.log" | tail -4 || true
    timeout 420 python3 bench/tune_fused_depth.py --rows "${TUNE_ROWS:-16,32,64,128}" --budget-s 90 \
      --check-rows "${CHECK_ROWS:-1,16,32,64,128}" --out "$out/h200-tune-fused-depth.json" 2>&1 \
      | grep -v Warn | tail -30 ;;
  profile) # kernel census of one depth frame and one decode step, uncompiled and compiled
    timeout 540 python3 bench/profile_stages.py --batch 16 2>&1 | tee "$out/profile.log" | tail -40
    timeout 300 python3 bench/profile_stages.py --batch 16 --compile 2>&1 | tail -40 ;;
  stages)  # per-stage step times, eager vs graph, for each depth-kernel mode
    timeout 540 python3 bench/stage_timing.py --batches 1,16,64 --modes plain,inductor,fused \
      --out "$out/h200-stage-timing.json" 2>&1 | tail -20 ;;
  ablation-eager) # (a) fixed 16-frame first chunk, eager, (b) progressive, eager, (c) + fused
    # depth, no graphs, and the naive baseline; eager runs stop starting requests after 60 s
    timeout 400 "${bench[@]}" --concurrency 16 --num-requests 300 --warmup 2 \
      --variants progressive-compiled,fixed16-eager,progressive-eager,naive --naive-requests 3 \
      --run-budget 60 --out "$out/h200-ablation.json" 2>&1 | grep '^\[bench' ;;
  ablation-a|ablation-b|ablation-c|ablation-d)  # one step of the ablation, 300 requests at c=16
    # (an eager step takes ~10 minutes for 300: run it as 2 shards on 2 GPUs); (c) adds the naive
    # baseline (in shard 1). Join shards with python -m breezert_bench.report --merge-shards, then
    # the steps with --merge.
    case "$phase" in
      ablation-a) variants=fixed16-eager ;;
      ablation-b) variants=progressive-eager ;;
      ablation-c) variants=progressive-compiled,naive ;;
      ablation-d) variants=progressive-graphs ;;
    esac
    name=h200-$phase
    [ -z "$shard" ] || name=$name-s${shard%/*}  # the naive baseline runs in shard 1 only
    timeout 560 "${bench[@]}" --concurrency 16 --num-requests 300 --warmup 2 \
      --variants "$variants" --naive-requests 5 --run-budget 450 ${shard:+--shard "$shard"} \
      --out "$out/$name.json" 2>&1 | grep '^\[bench' ;;
  sweep)   # closed loop 1, 4, 8, the latency profile as committed
    timeout 250 "${bench[@]}" --concurrency 1,4,8 --num-requests 300 --warmup 8 \
      --variants config --run-budget 60 --out "$out/h200-sweep.json" 2>&1 | grep '^\[bench' ;;
  latency|latency-nocap)  # the profile as committed (predictor on, fused DECODE) at 8-64
    # concurrent; -nocap lets a first chunk's CODEC step carry every ready chunk
    # (max_startup_codec_step_frames = max_codec_step_frames)
    case "$phase" in
      latency) spec='latency=config' ;;
      latency-nocap) spec='latency-nocap=config;scheduler.max_startup_codec_step_frames=256' ;;
    esac
    timeout 540 "${bench[@]}" --concurrency "${CONCURRENCY:-8,16,32,64}" --num-requests 300 \
      --warmup 16 --variant "$spec" --run-budget 80 --out "$out/h200-$phase.json" 2>&1 | grep '^\[bench' ;;
  predictor)  # predictor off vs on at 16, 32, 64 and an open-loop rate near capacity (also the
    # (d) point of the ablation: predictor-off is progressive-graphs)
    timeout 570 "${bench[@]}" --concurrency 16,32,64 --rate 12 --num-requests 300 --warmup 16 \
      --variants predictor-off,predictor-on --run-budget 80 \
      --variant 'predictor-off=progressive-graphs;scheduler.use_predictor=false' \
      --variant 'predictor-on=progressive-graphs;scheduler.use_predictor=true' \
      --out "$out/h200-predictor.json" 2>&1 | grep '^\[bench' ;;
  predictor-edf)  # overdue first chunks compete with urgent streams on slack (off by default):
    # predictor-on vs predictor-edf where the engine is at and past capacity
    timeout 570 "${bench[@]}" --concurrency 32 --rate 12 --num-requests 300 --warmup 16 \
      --variants predictor-on,predictor-edf --run-budget 80 \
      --variant 'predictor-on=progressive-graphs;scheduler.use_predictor=true' \
      --variant 'predictor-edf=progressive-graphs;scheduler.use_predictor=true;scheduler.predictor_overdue_startup_urgent=true' \
      --out "$out/h200-predictor-edf.json" 2>&1 | grep '^\[bench' ;;
  capacity-closed|capacity-open)  # issue 13: the eager codec (SnakeBeta unfused) against the
    # serving codec (fused kernels), one run; mixed-size replays are the only CODEC path (issue 32)
    case "$phase" in
      capacity-closed) load=(--concurrency "${CONCURRENCY:-16,32,64,128}") ;;
      capacity-open) load=(--rate "${RATES:-10,15,20,25}") ;;
    esac
    timeout 560 "${bench[@]}" "${load[@]}" --num-requests 300 --warmup 16 --run-budget 60 \
      --variant 'before=config;graph.fused_codec=false' \
      --variant 'after=config' \
      --out "$out/h200-$phase.json" 2>&1 | grep '^\[bench' ;;
  capacity-tests)  # issue 31: the 256-stream profile's KV pool sized from free memory (the full
    # model's weights, then the blocks that fit in cache.gpu_memory_fraction), before capacity-256
    timeout 300 python3 -m pytest tests/gpu/test_gpu_kv_sizing.py -q -s -p no:cacheprovider 2>&1 \
      | tee "$out/gpu_tests.log" | tail -8 ;;
  capacity-256)  # issue 31: configs/h200-capacity.toml (256 running requests, buckets to 256
    # requests / 512 rows, KV sized from free memory, refusal past capacity) side by side with the
    # 64-stream profile at c=128 and c=256 and open loop 40 req/s, one bench process. Two graph
    # captures (~80 s for the 64-stream profile, more for 256) and six runs may not fit one call:
    # VARIANTS=capacity-256 and VARIANTS=latency-64 run one each (own result file) in two
    # calls; CONCURRENCY / RATES change the load points (add 1,16 for the low-load check);
    # VARIANTS=capacity-256-no-start: the capacity profile without its bound on streams starting
    timeout 560 "${bench[@]}" --config configs/h200-capacity.toml \
      --concurrency "${CONCURRENCY:-128,256}" --rate "${RATES:-40}" \
      --num-requests 300 --warmup 16 --run-budget 60 \
      --variant 'capacity-256=config' --variant 'latency-64=@configs/h200-latency.toml' \
      --variant 'capacity-256-no-start=config;scheduler.admission_max_starting=256' \
      ${VARIANTS:+--variants "$VARIANTS"} \
      --out "$out/h200-capacity-256${VARIANTS:+-${VARIANTS//,/_vs_}}.json" 2>&1 | grep '^\[bench' ;;
  depth-census) # every GPU test, then per-stage graph times and the depth/decode census at 16
    # and 64 rows with the serving kernels (fused depth by row bucket, fused DECODE)
    timeout 330 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -4 || true
    timeout 150 python3 bench/stage_timing.py --batches 1,16,64 --modes fused-decode \
      --out "$out/h200-stage-timing.json" 2>&1 | grep -v Warn | tail -6 || true
    for rows in 16 64; do
      timeout 60 python3 bench/profile_stages.py --batch $rows --fused --fused-decode --compile \
        --top 14 2>&1 | grep -v Warn | tee -a "$out/h200-profile.log" | grep -A15 DEPTH || true
    done ;;
  first-packet-pdl)  # one call: GPU tests of the fused text encoder (split-K layout) and of
    # programmatic dependent launch, stage times with and without both (the text encoder's
    # columns show the one, depth and decode the other), then the engine today
    # against pdl + the fused text encoder at c=1 and 16
    timeout 220 python3 -m pytest tests/gpu/test_gpu_fused_text_encoder.py \
      "tests/gpu/test_gpu_fused_depth.py::test_pdl_changes_no_bit" \
      "tests/gpu/test_gpu_fused_decode.py::test_pdl_decode_changes_no_bit" -q -s \
      -p no:cacheprovider 2>&1 | tee "$out/gpu_tests_pdl.log" | grep -E 'lengths|passed|failed|^E ' || true
    timeout 150 python3 bench/stage_timing.py --batches 1,16,64 \
      --modes fused-decode,fused-te-pdl \
      --out "$out/h200-stage-timing-pdl.json" 2>&1 | grep -v Warn | tail -14 || true
    timeout 210 "${bench[@]}" --concurrency 1,16 --num-requests 300 --warmup 16 --run-budget 25 \
      --variant 'today=config' \
      --variant 'pdl-te=config;graph.pdl=true;graph.fused_text_encoder=true' \
      --out "$out/h200-first-packet-pdl.json" 2>&1 | grep '^\[bench' ;;
  depth-pdl)  # the split-K q/k/v GPU test, then the depth layers' frame with the per-bucket
    # shapes: plain launches, PDL, and the q/k/v GEMM split along K, at 1 to 128 rows (no
    # tuning); the census of a frame with PDL (where its ~1.1 ms of
    # sampling went) and of the first codec chunk (1 row x 1 frame); a tuning round at 16 rows
    timeout 100 python3 -m pytest "tests/gpu/test_gpu_fused_depth.py::test_split_k_qkv_is_close_and_batch_invariant" \
      -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests_qkv_split.log" | grep -E 'passed|failed|^E ' || true
    timeout 220 python3 bench/tune_fused_depth.py --rows '' --check-rows 1,16,64,128 \
      --out "$out/h200-depth-pdl.json" 2>&1 | grep -v Warn | tail -8 || true
    timeout 90 python3 bench/profile_stages.py --batch 16 --fused --fused-decode --compile \
      --pdl --top 16 2>&1 | grep -v Warn | tee "$out/h200-profile-pdl-sampler.log" \
      | grep -A17 DEPTH || true
    timeout 60 python3 bench/profile_stages.py --batch 1 --fused --fused-decode --codec-frames 1 \
      --top 12 2>&1 | grep -v Warn | tee "$out/h200-profile-codec-1.log" | grep -A13 CODEC || true
    timeout 110 python3 bench/tune_fused_depth.py --rows 16 --budget-s 65 --check-rows 16 \
      --out "$out/h200-tune-depth-16.json" 2>&1 | grep -v Warn | tail -4 ;;
  te-tokens)  # issues 13/14: the text encoder at the token buckets an opening burst packs
    # (16 sentences ~370 tokens, bucket 512; the simulator puts a 16-request TEXT_ENCODE step
    # at ~9 ms, the largest cost of a burst's wave): the fused layers up to 128 tokens (today),
    # up to 1024 (graph.fused_text_encoder_max_tokens) and the eager graph; its GPU test; then
    # the serving codec's census at 1 and 16 rows x 1 frame (the first chunks)
    timeout 330 python3 bench/stage_timing.py --batches 1 \
      --modes profile,profile-te-wide-tiles,profile-te-eager \
      --text-tokens 32,128,256,512,1024 --out "$out/h200-stage-timing-te-tokens.json" 2>&1 \
      | grep -v Warn | grep -iE 'text_encode|start-up|failed' || true
    timeout 100 python3 -m pytest tests/gpu/test_gpu_fused_text_encoder.py -q -s \
      -p no:cacheprovider 2>&1 | tee "$out/gpu_tests_text_encoder.log" \
      | grep -E 'lengths|passed|failed|^E ' || true
    for rows in 1 16; do
      timeout 70 python3 bench/profile_stages.py --batch $rows --fused --fused-decode --compile \
        --fused-codec --codec-frames 1 --top 12 2>&1 | grep -v Warn \
        | tee -a "$out/h200-profile-fused-codec.log" | grep -A13 CODEC || true
    done ;;
  path)  # issues 13/14: the profile as committed (fused text encoder up to 512 tokens since
    # 3 Dec) at c=1-64 with each first packet's time by part (own steps by stage, others', host:
    # first_packet_path) and the opening burst's step timeline (opening_burst), 32 new requests
    # per step at c=32 and 64, the census of one depth frame at 1 row with PDL and the fused
    # sampler (where its 6.3 ms of layers go), then each stage's graph at 1-64 rows
    timeout 200 "${bench[@]}" --concurrency "${CONCURRENCY:-1,16,32,64}" --num-requests 300 \
      --warmup 16 --run-budget 25 --variant 'profile=config' \
      --out "$out/h200-path.json" 2>&1 | grep '^\[bench' || true
    timeout 130 "${bench[@]}" --concurrency 32,64 --num-requests 300 --warmup 16 --run-budget 25 \
      --variant 'admit32=config;scheduler.max_text_encode_requests=32;scheduler.max_prefill_requests=32;scheduler.max_startup_codec_step_frames=64' \
      --out "$out/h200-path-admit32.json" 2>&1 | grep '^\[bench' || true
    timeout 80 python3 bench/profile_stages.py --batch 1 --fused --fused-decode --compile \
      --pdl --top 12 2>&1 | grep -v Warn | tee "$out/h200-profile-depth-1.log" \
      | grep -A13 DEPTH || true
    # each stage's graph at the row counts a burst brings (CODEC at 1 and 16 frames a row)
    timeout 90 python3 bench/stage_timing.py --batches 1,16,32,64 --modes profile \
      --out "$out/h200-stage-timing-path.json" 2>&1 | grep -v Warn | tail -12 || true ;;
  before-after)  # issue 32: the latency profile at c=1, 16 and 64 on the tree issue 32 was filed
    # against (6c89905, carried as .oldtree/: git archive 6c89905 runtime configs | tar -x -C
    # .oldtree) and on this one, one call, each tree in its own process. On an 80 GB card (H100,
    # 5 Dec) the old tree's KV pool, sized for the H200's worst case (32768 blocks, ~60 GB), ran
    # out of memory at start-up: there both trees get the same 16384 blocks (64 streams x 2 rows
    # x 2048 tokens), so the comparison stays like for like.
    gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
    latency_config=configs/h200-latency.toml
    if [ "$gib" -lt 100 ]; then
      for tree in .oldtree .; do
        sed 's/^\[cache\]$/[cache]\nnum_blocks = 16384/' "$tree/configs/h200-latency.toml" \
          > "$tree/configs/h200-latency-80g.toml"
      done
      latency_config=configs/h200-latency-80g.toml
    fi
    for tree in .oldtree .; do
      # the harness was the runtime's `breezert bench` until it became bench/'s breezert_bench
      if [ "$tree" = . ]; then name=after; rev=$commit; cmd=(python3 -m breezert_bench)
      else name=before; rev=6c89905; cmd=(python3 -m breezert.cli bench); fi
      (cd "$tree" && PYTHONPATH=/tmp/site:runtime:bench:. timeout 270 "${cmd[@]}" \
        --config "$latency_config" --texts "$OLDPWD/.benchdata/texts_en.tsv" \
        --tokenizer "$OLDPWD/.benchdata/tokenizer.json" --git-commit "$rev" \
        --concurrency 1,16,64 --num-requests 300 --warmup 16 --run-budget 25 \
        --out "$out/h200-latency-$name.json" 2>&1 | grep '^\[bench' || true)
    done ;;
  capacity-ab)  # issue 31: the capacity profile (configs/h200-capacity.toml) at c=256, closed
    # loop (CONCURRENCY), on the previous tree (.prevtree/: git archive $(cat .prevtree/COMMIT)
    # runtime configs, carried) and on this one, one call, each tree's runtime in its own process
    # under this tree's harness. Each start-up captures graphs up to 256 requests (~1-2 min).
    # AB_ORDER=after-first runs this tree first (6 Dec: the second tree's TTFB was 5-48 ms higher
    # at every point, the order's effect or the tree's; one run each cannot tell).
    prev=$(cat .prevtree/COMMIT)
    trees=(.prevtree .)
    [ "${AB_ORDER:-}" != after-first ] || trees=(. .prevtree)
    for tree in "${trees[@]}"; do
      if [ "$tree" = . ]; then name=after; rev=$commit; else name=before; rev=$prev; fi
      PYTHONPATH=/tmp/site:$tree/runtime:bench:. timeout 270 python3 -m breezert_bench \
        --config "$tree/configs/h200-capacity.toml" --texts .benchdata/texts_en.tsv \
        --tokenizer .benchdata/tokenizer.json --git-commit "$rev" \
        --concurrency "${CONCURRENCY:-256}" ${RATES:+--rate "$RATES"} --num-requests 300 \
        --warmup 16 --run-budget 60 --out "$out/h200-capacity-$name.json" 2>&1 \
        | grep '^\[bench' || true
    done ;;
  gc)  # a full garbage-collector pass on the warmed H200 engine, with and without the start-up
    # heap frozen (bench/gc_pause.py; ~1 min with the engine's start-up)
    timeout 200 python3 bench/gc_pause.py --config configs/h200-latency.toml --repeats 7 \
      --git-commit "$commit" --out "$out/h200-gc-pause.json" 2>&1 | grep -v Warn | tail -3 ;;
  tests-changed)  # the GPU tests of what issues 30-32 changed (slot table, graphs, host
    # syncs, fused DECODE/PREFILL builders, the depth layers' row buckets)
    timeout 400 python3 -m pytest tests/gpu/test_gpu_slot_state.py tests/gpu/test_gpu_graphs.py \
      tests/gpu/test_gpu_host_syncs.py tests/gpu/test_gpu_fused_depth.py \
      tests/gpu/test_gpu_fused_decode.py tests/gpu/test_gpu_fused_prefill.py \
      -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
  tune-decode)  # issue 13: the fused DECODE step's launch shapes (DECODE_TILES = Tiles() today:
    # 2.33 ms at one row, 1.2 TB/s of the backbone's 2.8 GB); only bit-preserving fields
    timeout 200 python3 bench/tune_fused_decode.py --rows 2,32,128 --context 256 --budget-s 110 \
      --out "$out/h200-tune-fused-decode.json" 2>&1 | grep -v Warn | tail -25 || true ;;
  trace)  # issue 14: one request's first packet on the idle serving engine, each step on the
    # host and on the GPU (CUDA events), and the kernel census of the whole first packet
    timeout 200 python3 bench/first_packet_trace.py --config configs/h200-latency.toml \
      --texts .benchdata/texts_en.tsv --tokenizer .benchdata/tokenizer.json --requests 5 \
      --out "$out/h200-first-packet-trace.json" 2>&1 | grep -v Warn | tail -40 || true ;;
  prefill)  # issue 14: the fused PREFILL step (graph.fused_prefill; the eager one took 5.3 ms of
    # one request's 17.9 ms first packet, trace at 533276d): its GPU tests, then the first
    # packet on the idle engine with it
    timeout 170 python3 -m pytest tests/gpu/test_gpu_fused_prefill.py -q -s -p no:cacheprovider \
      2>&1 | tee "$out/gpu_tests_prefill.log" | grep -E 'fused vs|passed|failed|^E ' || true
    timeout 200 python3 bench/first_packet_trace.py --config configs/h200-latency.toml \
      --texts .benchdata/texts_en.tsv --tokenizer .benchdata/tokenizer.json --requests 5 \
      --set graph.fused_prefill=true --out "$out/h200-first-packet-trace-fused-prefill.json" \
      2>&1 | grep -v Warn | tail -40 || true ;;
  prefill-bench)  # issues 13/14: the profile (fused PREFILL on since 3 Dec) against the eager
    # prefill, one run, c=1-32
    timeout 560 "${bench[@]}" --concurrency "${CONCURRENCY:-1,16,32}" --num-requests 300 \
      --warmup 16 --run-budget 25 --variant 'profile=config' \
      --variant 'eager-prefill=config;graph.fused_prefill=false' \
      --out "$out/h200-prefill-bench.json" 2>&1 | grep '^\[bench' || true ;;
  admit)  # issue 13: 32 new requests per TEXT_ENCODE / PREFILL step with first-chunk CODEC steps
    # of up to 64 frames, against the profile (16 / 16 frames); the simulator (3 Dec,
    # sim-what-if-20261203.json) puts c=32 p95 89 -> 48 ms and c=64 222 -> 180 ms, 0 underruns
    timeout 560 "${bench[@]}" --concurrency "${CONCURRENCY:-16,32,64}" --num-requests 300 \
      --warmup 16 --run-budget 40 --variant 'profile=config' \
      --variant 'admit32=config;scheduler.max_text_encode_requests=32;scheduler.max_prefill_requests=32;scheduler.max_startup_codec_step_frames=64' \
      --out "$out/h200-admit.json" 2>&1 | grep '^\[bench' ;;
  slack)  # issue 13: at c=64 the underruns are each a few ms late (2 Dec: 5-35 of 300, the
    # latest chunk 1-18 ms): the predictor's urgency margin 0.05 s (profile) against 0.1 and 0.2
    timeout 560 "${bench[@]}" --concurrency "${CONCURRENCY:-32,64}" --num-requests 300 \
      --warmup 16 --run-budget 30 --variant 'slack50=config' \
      --variant 'slack100=config;scheduler.predictor_min_slack_s=0.1' \
      --variant 'slack200=config;scheduler.predictor_min_slack_s=0.2' \
      --out "$out/h200-slack.json" 2>&1 | grep '^\[bench' ;;
  burst)  # issue 13: the c=64 TTFB p95 is its opening burst (1 Dec runs: the 64 first packets
    # in five waves ~48 ms apart, p95 231-266 ms; the 236 after it p95 62-95 ms). New requests
    # per TEXT_ENCODE / PREFILL step, today 16 (chosen at 13a5887), against 32 and 64; c=32, 64
    timeout 560 "${bench[@]}" --concurrency "${CONCURRENCY:-32,64}" --num-requests 300 \
      --warmup 16 --run-budget 40 --variant 'new16=config' \
      --variant 'new32=config;scheduler.max_text_encode_requests=32;scheduler.max_prefill_requests=32' \
      --variant 'new64=config;scheduler.max_text_encode_requests=64;scheduler.max_prefill_requests=64' \
      --out "$out/h200-burst.json" 2>&1 | grep '^\[bench' ;;
  codec-layout)  # issue 31: the fast codec's layout (channels-last, the only one since the
    # channels-first fast path was deleted): the codec's GPU tests (same waveform as the eager
    # modules, SNR bounds, chunking, a mixed-size graph replay), the served step timed with
    # cuDNN's heuristics and then with its algorithms timed (--cudnn-benchmark: the census of 7
    # Dec had 19 convertTensor launches at 256 x 1; compare the two runs' "after" columns, the
    # runtime's codec), then its CODEC census at 256 rows x 1 frame (launches, the transposes left)
    timeout 240 python3 -m pytest tests/gpu/test_gpu_codec.py -q -p no:cacheprovider 2>&1 \
      | tee "$out/codec_tests.log" | tail -4
    for bench_mode in heuristics cudnn-benchmark; do
      flag=""; [ "$bench_mode" = heuristics ] || flag=--cudnn-benchmark
      timeout 240 python3 bench/codec_ab.py --change upsampler $flag \
        --out "$out/h200-codec-served-$bench_mode.json" 2>&1 | grep -v Warn | tail -9
    done
    timeout 200 python3 bench/profile_stages.py --preset full --batch 256 --codec-frames 1 \
      --fused --fused-decode --fused-codec --top 30 2>&1 | grep -v Warn \
      > "$out/h200-census-codec-cl-256.txt" || true
    grep -A12 CODEC "$out/h200-census-codec-cl-256.txt" || true ;;
  codec-upsampler)  # issue 31: the serving codec's step with the wide upsampler's GEMM on the
    # rows as they lie (the runtime) against the transposed view of 5 Dec, its output made
    # channels-first (bench/codec_ab.py), one process; then the codec's GPU tests
    timeout 300 python3 bench/codec_ab.py --change upsampler \
      --out "$out/h200-codec-upsampler-ab.json" \
      2>&1 | grep -v Warn | tail -12
    timeout 200 python3 -m pytest tests/gpu/test_gpu_codec.py -q -p no:cacheprovider 2>&1 \
      | tee "$out/codec_tests.log" | tail -3 ;;
  codec-state)  # issue 31: the codec's state read and written in its slots (K/V rings one
    # kernel a layer, conv histories by the kernels around each conv) against the whole state
    # gathered and scattered around the step (bench/codec_ab.py); the GPU tests first: the
    # codec's (the kernels' own too) and the engine's graphs (the stage's strided slot column)
    timeout 300 python3 -m pytest tests/gpu/test_gpu_codec.py tests/gpu/test_gpu_graphs.py -q \
      -p no:cacheprovider 2>&1 | tee "$out/codec_tests.log" | tail -4
    timeout 300 python3 bench/codec_ab.py --change state --out "$out/h200-codec-state-ab.json" \
      2>&1 | grep -v Warn | tail -12 ;;
  codec-precision)  # issue 31: the codec's precisions side by side (bench/codec_precision.py:
    # SNR against strict fp32, streamed against one-shot, step ms at 1-256 streams; fp16 new on
    # 5 Dec), then the codec's GPU tests (fp16 held to TF32's SNR bound)
    timeout 420 python3 bench/codec_precision.py --out "$out/h200-codec-precision.json" \
      --precisions "${PRECISIONS:-tf32,fp16,bf16,tf32-fast,fp16-fast,bf16-fast}" 2>&1 \
      | grep -v Warn | tail -40
    timeout 150 python3 -m pytest tests/gpu/test_gpu_codec.py -q -p no:cacheprovider 2>&1 \
      | tee "$out/codec_tests.log" | tail -5 ;;
  decode-attention)  # issue 31: the DECODE attention alone (bench/decode_attention_ab.py), one
    # layer at 64/256/512 rows x 256-2048 tokens, 4 launch shapes of the served tensor-core
    # kernel (dot:tile/split/warps/stages) and the elementwise one it replaced (32/128/4), each
    # with its K/V read's GB/s and its difference from fp32 torch
    # (6 Dec, H100: 8.9 of a 256-row step's 16.3 ms at 512 tokens, twice the read's time)
    timeout 420 python3 bench/decode_attention_ab.py --out "$out/h200-decode-attention-ab.json" \
      2>&1 | grep -v Warn | tail -100 ;;
  steady)  # issue 31: where a loaded step's time goes (bench/steady_trace.py): schedule, input
    # prep, GPU work, post and commit per stage at STREAMS (256,64) on the capacity profile,
    # Engine.step on one thread; every stream is added at once, so the queue limit, admission
    # and the queue's wait are lifted, and a newcomer past its first-chunk deadline competes with
    # the streams on slack (predictor_overdue_startup_urgent): past real time (the H100, 5 Dec)
    # the deadline policy served the first 64 streams and the other 192 never started (since
    # 1b5cde3 they would, each starvation_limit_s past its deadline: a slow start, the recorded
    # steps the same). 5 Dec: busy 74 % at 256 with DEPTH's prep 8.7 ms; the host_before_calls /
    # host_in_calls columns split that prep (Python vs copies + launch); --launch-probe then
    # times each captured graph's launch on the host beside its GPU time. Start-up with a cold
    # Inductor cache took > 400 s once: give it a call of its own (timeout_s 600); the log is
    # written as it goes ($out/steady.log), so a call cut short still says how far it got.
    # Since 6 Dec (second session) each request is as long as its text and replaced when it ends
    # (steady_trace --lengths text): that run's 3,000-frame streams held >1k-token contexts.
    timeout 540 python3 bench/steady_trace.py --config configs/h200-capacity.toml \
      --texts .benchdata/texts_en.tsv --tokenizer .benchdata/tokenizer.json \
      --streams "${STREAMS:-256,64}" --steps 300 --git-commit "$commit" \
      --set scheduler.max_queued_requests=512 --set scheduler.admission_capacity=1000000.0 \
      --set scheduler.max_queue_wait_s=60.0 \
      --set scheduler.predictor_overdue_startup_urgent=true --launch-probe \
      --out "$out/h200-steady-trace.json" 2>&1 | grep --line-buffered -v -i \
      "warn\|softmax\|important use" | grep --line-buffered -v '^$' | tee "$out/steady.log" \
      | tail -60 ;;
  big-batch)  # issue 31: each stage's graphed step at 64 / 128 / 256 requests (BATCHES), the
    # profile's kernels (fused Triton depth layers) against `plain` (the same stages in plain
    # torch: cuBLAS GEMMs for the depth layers), one process (bench/stage_timing.py)
    timeout 560 python3 bench/stage_timing.py --modes "${MODES:-profile,plain}" \
      --batches "${BATCHES:-64,128,256}" --text-tokens 64 \
      --out "$out/h200-stage-timing-big.json" 2>&1 | grep -v Warn | tail -12 ;;
  depth-gemm)  # issues 30/31: the depth layer's GEMMs as served, with Tiles.prenorm, in cuBLAS
    # and as plain TMA Triton GEMMs at 2-512 rows (bench/depth_gemm_ceiling.py; its JSON is
    # written after each row count), then the fused depth layers' same-bits GPU tests (PDL and
    # prenorm against the served path at 1-512 rows); the file's other tests run in tests-changed
    # (the script's own order unless GEMM_ROWS: largest first, so a timeout keeps capacity's)
    timeout "${GEMM_TIMEOUT:-300}" python3 bench/depth_gemm_ceiling.py \
      ${GEMM_ROWS:+--rows "$GEMM_ROWS"} --out "$out/h200-depth-gemm-ceiling.json" 2>&1 \
      | grep -v Warn | tail -40 || echo "depth_gemm_ceiling failed: $?"
    timeout 200 python3 -m pytest tests/gpu/test_gpu_fused_depth.py -k switch_changes_no_bit \
      -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests_fused_depth.log" | tail -12 ;;
  depth-tests)  # issue 30: the depth frame's GPU tests (the one-launch draw against the torch
    # path, the fused layers against eager and their same-bits switches)
    timeout "${DEPTH_TESTS_TIMEOUT:-240}" python3 -m pytest tests/gpu/test_gpu_depth_draw.py \
      tests/gpu/test_gpu_fused_depth.py -q -p no:cacheprovider 2>&1 \
      | tee "$out/gpu_tests_depth.log" | tail -12 || true ;;
  timeline)  # issue 30, deliverable 3: the depth frame as served (configs/h200-capacity.toml's
    # switches, CFG) at 1/16/64/128/256 requests: graph-replay ms, launches, GPU busy, bytes and
    # FLOPs, achieved TB/s and TFLOP/s against the device's floor (bench/depth_timeline.py)
    # and the same frame with graph.fused_depth_draw on (kernels/depth_draw.py), side by side.
    # TIMELINE_ARGS: bench/depth_timeline.py's options instead of --fused-draw
    timeout "${TIMELINE_TIMEOUT:-420}" python3 bench/depth_timeline.py ${TIMELINE_ARGS:---fused-draw} \
      ${TIMELINE_REQUESTS:+--requests "$TIMELINE_REQUESTS"} --out "$out/h200-depth-timeline.json" \
      2>&1 | grep -v Warn | tail -32 ;;
  census-256)  # issue 31: the kernel census (torch.profiler, eager) of one CODEC step of 256
    # streams x 1 frame and one DEPTH frame of 256 requests with the profile's fused kernels:
    # which kernels hold the codec's 0.11-0.2 ms a frame at capacity; then the same at 1 stream.
    # CENSUS_BATCH (256) sets the requests; CENSUS_ARGS adds switches ('--compile --pdl': the
    # sampler compiled and PDL, as the serving profiles run the depth frame)
    timeout 300 python3 bench/profile_stages.py --preset full --batch "${CENSUS_BATCH:-256}" \
      --codec-frames 1 --fused --fused-decode --fused-codec --top 30 ${CENSUS_ARGS:-} 2>&1 \
      | grep -v Warn \
      | tee "$out/h200-census-256.txt" | tail -40
    # and one stream's one-frame CODEC step (the first packet's 2.7-2.9 ms)
    timeout 200 python3 bench/profile_stages.py --preset full --batch 1 --codec-frames 1 \
      --fused --fused-decode --fused-codec --top 40 2>&1 | grep -v Warn \
      > "$out/h200-census-1.txt" || true ;;
  margin)  # issue 31: admission at the capacity profile's headroom with a larger safety factor on
    # every predicted step (scheduler.predictor_time_margin, MARGINS, default 1.3 and 1.4) at
    # c=128 and 40 / 60 req/s, one bench process
    variants=()
    for m in ${MARGINS:-1.3 1.4}; do
      variants+=(--variant "margin-$m=config;scheduler.predictor_time_margin=$m"); done
    timeout 560 "${bench[@]}" --config configs/h200-capacity.toml --concurrency 128 \
      --rate "${RATES:-40,60}" --num-requests 300 --warmup 16 --run-budget 60 "${variants[@]}" \
      --out "$out/h200-capacity-256-margin.json" 2>&1 | grep '^\[bench' ;;
  room)  # issue 34: real LiveKit calls (bench/room.py): livekit-server on loopback, per engine
    # setting one engine (ROOM_CONFIG, configs/h200-latency.toml by default; full-size random
    # bf16) apart from the agents
    # (ROOM_ENGINE=server: bench/room_engine.py, the app of breezert serve; agent workers of
    # ROOM_PER_AGENT rooms, 4, reach it with the plugin's TTS(base_url=...); ROOM_ENGINE=in-process:
    # one agent worker with the plugin's in-process engine, which stalled at N=16 on 6 Dec:
    # livekit's per-process FFI fan-out), ROOM_N listener rooms (default 16,64) with ROOM_TURNS
    # closed-loop turns each (default 2) and, with ROOM_RATE, an open-loop run at that many
    # turns/s and, with ROOM_WAVE_GAP_S, a run in waves (all rooms start each turn together,
    # that many seconds apart; ROOM_NO_CLOSED=1 leaves the closed loop out), in the four
    # feedback variants (ROOM_VARIANTS); ROOM_PER_PROCESS listener rooms share one process (4;
    # each turn records how late that process's loop ran: loop_lag_max_s). Carry only
    # .roombundle (make room-bundle: server, packages, trimmed tokenizer, texts, COMMIT); the
    # tree and it just fit one call's 64 MiB. ROOM_TIMEOUT_S (540) leaves the logs time to pack.
    # ROOM_SET: engine overrides (room.py --set, section.key=value;...), as SCALE_SET below.
    # ROOM_ENGINE_CPUS: the engine server keeps to that many CPUs, the harness to the rest
    # (7 Dec: at N=128, 8 rooms a process, the crowded harness slowed the engine's cycle and
    # its admission refused from 16 streams; the next session's 4 CPUs for the engine and 4
    # rooms a process left 64 harness processes 12 CPUs and the harness lagged; unpinned, 8
    # rooms a process and ROOM_SET='scheduler.admission_max_cycle_s=1.0' heard 254 of 256).
    d=/tmp/room
    room_prepare "$d"
    n=${ROOM_N:-16,64}
    timeout "${ROOM_TIMEOUT_S:-540}" python3 bench/room.py --server-bin "$d/livekit-server" \
      --config "${ROOM_CONFIG:-configs/h200-latency.toml}" --tokenizer "$d/tokenizer-trimmed.json" \
      --engine "${ROOM_ENGINE:-server}" --rooms-per-worker "${ROOM_PER_AGENT:-4}" \
      --texts .roombundle/texts_en.tsv --listeners "$n" --turns "${ROOM_TURNS:-2}" \
      --rooms-per-process "${ROOM_PER_PROCESS:-4}" --join-timeout-s "${ROOM_JOIN_TIMEOUT_S:-240}" \
      ${ROOM_RATE:+--rate "$ROOM_RATE"} ${ROOM_WAVE_GAP_S:+--wave-gap-s "$ROOM_WAVE_GAP_S"} \
      ${ROOM_NO_CLOSED:+--no-closed} --set "${ROOM_SET:-}" \
      ${ROOM_ENGINE_CPUS:+--engine-cpus "$ROOM_ENGINE_CPUS"} \
      --variants "${ROOM_VARIANTS:-listener,agent-queue,none,predictor-off}" \
      --out "$out/h200-room-n${n//,/-}.json" 2>&1 | grep -vE 'Warn|^\{' | tail -40 \
      || echo "room.py ended with $? (124: ROOM_TIMEOUT_S)"
    # the logs come back also after a timeout (4 Dec: set -e ended the phase before this line)
    (cd /tmp && tar czf "$out/room-logs.tgz" breezert-room-*) 2>/dev/null || true ;;
  scaleout)  # issue 36: K engines behind LiveKit's dispatcher on the 4-GPU machine (kind
    # nvidia-h200-x4; bench/room.py): livekit-server on loopback and SCALE_K engines (1, 2 or 4;
    # default 4; configs/h200-latency.toml, full-size random bf16, 64 running requests: full at
    # 64 calls), engine i on GPU i (CUDA_VISIBLE_DEVICES). ROOM_ENGINE=server (default): each
    # engine apart (bench/room_engine.py) with agent processes of ROOM_PER_AGENT rooms (4; agent
    # i on engine i mod K, one agent name), which report their engine's load from its /readyz
    # (SCALE_DISPATCH engine), LiveKit's default CPU load (cpu) or none (rooms); an agent
    # declines a room past its share. ROOM_ENGINE=in-process: K agent workers each with its
    # engine in process (64 rooms in one process: livekit's per-process FFI fan-out stalled 16
    # on 6 Dec). ROOM_N x SCALE_K listener rooms (ROOM_N, default 64: one GPU's load, so K=1,
    # 2, 4 are 1x, 2x, 4x it) of ROOM_TURNS closed-loop turns (2) in variant SCALE_VARIANT
    # (none); comma-separated dispatch modes each get fresh processes (longer than one call at
    # K=4). ROOM_PER_PROCESS (4) rooms share a listener process at every K; each engine's torch
    # runs SCALE_THREADS (4) CPU threads. One call per (SCALE_K, SCALE_DISPATCH); carry
    # .roombundle alone, as phase room. Results: $OUT/h200x4-scaleout-k<K>-<dispatch>.json (+
    # its PNGs); merge them afterwards, anywhere:
    # python bench/room_scaleout.py --out bench/results/h200x4-scaleout.json <the JSONs>.
    # On one GPU, the harness with two engines on it: CUDA_VISIBLE_DEVICES=0,0 SCALE_K=2
    # ROOM_N=16 SCALE_SET='cache.num_blocks=4096' (SCALE_SET: engine overrides, room.py --set,
    # here a KV pool each that two engines fit beside each other).
    d=/tmp/room
    room_prepare "$d"
    k=${SCALE_K:-4}
    dispatch=${SCALE_DISPATCH:-engine}
    n=$(python3 -c "import sys; print(','.join(str(int(x) * int(sys.argv[2])) for x in sys.argv[1].split(',')))" "${ROOM_N:-64}" "$k")
    if [ "${ROOM_ENGINE:-server}" = server ]; then
      scale=(--engine server --engines "$k" --rooms-per-worker "${ROOM_PER_AGENT:-4}")
    else
      scale=(--workers "$k")
    fi
    BREEZERT_ROOM_THREADS=${SCALE_THREADS:-4} timeout "${ROOM_TIMEOUT_S:-540}" python3 bench/room.py \
      --server-bin "$d/livekit-server" --config configs/h200-latency.toml \
      --tokenizer "$d/tokenizer-trimmed.json" --texts .roombundle/texts_en.tsv \
      "${scale[@]}" --dispatch "$dispatch" --listeners "$n" --turns "${ROOM_TURNS:-2}" \
      --rooms-per-process "${ROOM_PER_PROCESS:-4}" --join-timeout-s "${ROOM_JOIN_TIMEOUT_S:-240}" \
      --variants "${SCALE_VARIANT:-none}" --set "${SCALE_SET:-}" \
      --out "$out/h200x4-scaleout-k$k-${dispatch//,/-}.json" \
      2>&1 | grep -vE 'Warn|^\{' | tail -40 || echo "room.py ended with $? (124: ROOM_TIMEOUT_S)"
    (cd /tmp && tar czf "$out/scaleout-logs.tgz" breezert-room-*) 2>/dev/null || true ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac

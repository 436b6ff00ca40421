# Hard failures on CUDA (manual check on a GPU machine; CI has none): each method of a 4-stage cpu-tiny
# run on the GPU survives three SIGKILLed stage processes (benchmarks/scenarios/hard-failures-kills.csv).
# Expects wheels of pydantic and simpy in .whl/ where the machine has no package index; writes
# recoveries-METHOD.csv into $OUT. Results of one run on an H200: benchmarks/results/cuda-hard-failures-h200/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1 || exit 1
cp benchmarks/scenarios/hard-failures-cuda.json /tmp/hard-cuda.json && cp benchmarks/scenarios/hard-failures-kills.csv /tmp/kills.csv && cd /tmp
for m in checkfree redundant async_checkpoint checkpoint; do
  echo "=== $m"; 
  timeout 150 python3 -m churnsim.cli real run hard-cuda.json --method $m --out run-$m 2>&1 | grep -v -i "warn\|return Variable" | tail -3
  echo "rc=${PIPESTATUS[0]}"
  cp run-$m/recoveries.csv $OUT/recoveries-$m.csv 2>/dev/null; head -5 run-$m/recoveries.csv 2>/dev/null | cut -c1-300
done

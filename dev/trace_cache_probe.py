"""What a second process compiles when Thunder's programs come from kforge's trace cache.

    python3 dev/trace_cache_probe.py [model] [setup]     (default: plain-llama bf16, bench size, B=8 T=1024)

Runs the bench's first step (kforge.jit) in two processes with KFORGE_TRACE_CACHE=1 and one fresh
cache directory: the first traces and writes, the second restores. Each prints its first-step time,
loss, NVRTC compile count and trace-cache counters, then every fusion region (structure digest,
layout keys, program names); kforge's INFO log lines that name a compile or the trace cache follow.
Extra arguments after the set-up name programs whose region IR to print.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

model = sys.argv[1] if len(sys.argv) > 1 else "plain-llama"
setup = sys.argv[2] if len(sys.argv) > 2 else "bf16"
from kforge.bench.models import DEFAULT_SIZE  # noqa: E402
from kforge.zoo import MODELS  # noqa: E402

spec = dict(label=model, spec=MODELS[model], size=DEFAULT_SIZE.get(model), setup=setup, backend="kforge",
            batch=8, seq=1024, device="cuda", cudagraphs=False, path=None)
env = dict(os.environ, KFORGE_TRACE_CACHE="1", KFORGE_CACHE_DIR=tempfile.mkdtemp(prefix="kforge-tc-"))
# The child: the bench's first step, then each fusion region's structure digest, layout keys and
# program names, so that the two processes' regions can be compared.
code = """
import hashlib, json, logging, sys
logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')
from kforge.bench import models as m
spec = json.loads(sys.argv[1])
built = m.build(m.ModelCase(spec['label'], spec['spec'], spec['size']), spec['setup'], batch=spec['batch'],
                seq=spec['seq'], device='cuda')
row = m.train_row(built, 'kforge', steps=0, warmup=1, cudagraphs=False, first_only=True)
from kforge import trace_cache
from kforge.fusion.executor import regions
from kforge.fusion.ir import format_ir
print(json.dumps({'first_s': row['first_s'], 'loss': row['first_loss'], 'nvrtc': row.get('nvrtc_compiles'),
                  'stats': trace_cache.stats()}))
for fr in regions():
    print('REGION', hashlib.sha1(fr.key.encode()).hexdigest()[:10], fr.kernel.keys(),
          {k: v.program for k, v in fr.sources.items()})
    if any(v.program in PROGS for v in fr.sources.values()):
        print(format_ir(fr.ir))
""".replace("PROGS", repr(sys.argv[3:] if len(sys.argv) > 3 else ["kf_fusion_f83c0255e907c9d1", "kf_fusion_ac2f3b6ae0b663b5"]))
for i in (1, 2):
    r = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env)
    print(f"== process {i}: exit {r.returncode}")
    print(r.stdout.strip() if r.stdout.strip() else "(no stdout)", r.stderr[-2000:] if r.returncode else "")
    for line in r.stderr.splitlines():
        if line.startswith("kforge") and ("compiled" in line or "trace cache" in line or "restor" in line):
            print("  ", line[:300])

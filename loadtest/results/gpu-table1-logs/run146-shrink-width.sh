${PY:-python3} -c "
import sys, loadtest.bench_lora_tiles as b
from preft.vllm_plugin import lora_kernels as lk
from preft.vllm_plugin.tiles import Tiles as T
S = {'shrink': [T(64,64,4,4), T(64,64,8,4)], 'expand': [lk._TILES['expand']]}
b.shapes = lambda k: S[k]
out, extra = sys.argv[1], sys.argv[2:]
for w in (128, 0, 256):
    lk.SHRINK_WIDTH = w
    sys.argv[1:] = ['--models', 'qwen05,llama8b', '--ranks', '64,8', '--out', f'{out}-w{w}', *extra]
    b.main()
" "$@"

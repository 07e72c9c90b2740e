// setmaxnreg_plain.cu — does ptxas size a region by its setmaxnreg.inc? Launch bound 768
// threads (80 registers); warpgroup 0 raises itself to 240 and keeps 100 floats live.
// nvcc -gencode arch=compute_90a,code=sm_90a -Xptxas -v -c setmaxnreg_plain.cu
// CUDA 13.0: "Used 80 registers", 0 bytes spill (at .inc 120 instead: 488 B spilled).
#include <cstdint>
__global__ void __launch_bounds__(768, 1) k(float* out, const float* in, int n) {
  int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    float acc[100];
#pragma unroll
    for (int i = 0; i < 100; ++i) acc[i] = in[i * n + threadIdx.x];
    for (int j = 0; j < n; ++j) {
#pragma unroll
      for (int i = 0; i < 100; ++i) acc[i] = acc[i] * acc[(i + 1) % 100] + 1.0f;
    }
#pragma unroll
    for (int i = 0; i < 100; ++i) out[i * n + threadIdx.x] = acc[i];
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
    out[threadIdx.x] = 0;
  }
}

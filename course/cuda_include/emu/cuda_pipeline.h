// CUDA's cuda_pipeline.h: for the emulator, its primitives (the C++ cuda::pipeline API is not emulated).
#pragma once
#include <cuda_pipeline_primitives.h>

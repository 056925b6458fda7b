// cg::inclusive_scan / exclusive_scan live in the emulator's cooperative_groups.h.
#pragma once
#include <cooperative_groups.h>

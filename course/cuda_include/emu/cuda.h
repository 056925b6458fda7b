// The CPU emulator needs nothing from the CUDA runtime header: everything is in its prelude.
#pragma once

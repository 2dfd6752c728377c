#pragma once
// Library version; DDP_VERSION is major * 10000 + minor * 100 + patch.
#define DDP_VERSION_MAJOR 0
#define DDP_VERSION_MINOR 1
#define DDP_VERSION_PATCH 0
#define DDP_VERSION (DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH)

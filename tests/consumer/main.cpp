// A tiny consumer of the installed / fetched package: uses the public API and checks it.
#include <ddp/ddp.hpp>

#include <cstdio>

int main() {
  ddp::store::hash_store store;
  store.set_string("answer", "42");
  if (store.get_string("answer") != "42") return 1;
  if (ddp::float16(1.5f).bits != 0x3e00) return 2;
  std::printf("ddp %d consumer ok\n", DDP_VERSION);
  return 0;
}

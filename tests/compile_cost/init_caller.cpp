// The control: the file that calls init_process_group compiles the ring backend, so a check
// that cannot see the backend's symbols fails here.
// expect: ring backend
#include <ddp/ddp.hpp>

int main() { return ddp::init_process_group("ring").size() > 0 ? 0 : 1; }

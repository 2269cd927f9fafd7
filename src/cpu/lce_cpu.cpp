// PENDING: being written (cpu backend helper).
#include "backend.hpp"
namespace ikbo::detail::cpu {
}

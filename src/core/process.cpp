#include "core/process.h"

#include <sys/resource.h>

namespace tiller {

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

}  // namespace tiller

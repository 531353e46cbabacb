// Facts about this process (private to src/).
#pragma once

namespace tiller {

// Peak resident memory of this process since it started, MB.
double peak_rss_mb();

}  // namespace tiller

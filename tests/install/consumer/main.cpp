// Uses the installed tiller: loads a config, plans it on 2 nodes x 4 GPUs, prints the actor group.
#include <cstdio>

#include <tiller/tiller.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer CONFIG\n");
    return 2;
  }
  try {
    tiller::JobConfig config = tiller::load_config(argv[1]);
    const int world = tiller::dist::required_world_size(config);
    auto plan = tiller::dist::make_rank_plan(config, tiller::dist::NodeMap::fill_by_slot({4, 4}, world));
    std::printf("consumer: tiller %s planned %d ranks; actor group has %zu ranks\n", tiller::version(),
                plan.world_size, plan.group("actor")->ranks.size());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}

#include "tiller/tiller.h"

int main(int argc, char** argv) { return tiller::run_main(argc, argv); }

#include "experiments/commands.h"
#include <CLI/CLI.hpp>
namespace sbp { void add_demo_options(CLI::App&, DemoArgs&) {} int demo_command(const DemoArgs&, const std::string&) { return 1; } }

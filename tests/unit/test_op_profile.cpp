// The op profile counts outermost ops only: an op called by another op is part of the caller's time.
#include <catch2/catch.hpp>

#include <map>
#include <sstream>

#include <ATen/ATen.h>

#include "profiler/op_profile.h"

TEST_CASE("the op profile counts every outermost op once and none of the ops they call", "[profiler]") {
  const auto a = at::randn({64, 32}), w = at::randn({16, 32}), wt = w.t();
  std::map<std::string, std::int64_t> calls;
  {
    sbp::OpProfile profile;
    for (int i = 0; i < 3; ++i) (void)at::mm(a, wt);
    (void)at::linear(a, w);  // calls matmul/mm inside: counted as one linear, no extra mm
    for (const auto& op : profile.totals()) calls[op.name] = op.calls;
    CHECK_THROWS_WITH(sbp::OpProfile(), Catch::Contains("another op profile is active"));
  }
  CHECK(calls["aten::mm"] == 3);
  CHECK(calls["aten::linear"] == 1);
  CHECK(calls.count("aten::matmul") == 0);
  sbp::OpProfile again;  // the first one is gone: a new one may start
  (void)at::mm(a, wt);
  const auto ops = again.totals();
  REQUIRE(ops.size() == 1);
  std::ostringstream csv;
  sbp::write_op_profile_csv(ops, 0.0, csv);
  CHECK(csv.str().rfind("name,calls,seconds,share\naten::mm,1,", 0) == 0);
  CHECK(csv.str().back() == '\n');
}

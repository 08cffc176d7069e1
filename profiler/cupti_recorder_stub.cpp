// cupti_recorder.h for builds without CUDA: nothing to record. The writers are in cupti_export.cpp.
#include "profiler/cupti_recorder.h"

namespace sbp {

CuptiRecorder::~CuptiRecorder() = default;

bool CuptiRecorder::start(std::string* reason) {
  if (reason) *reason = "built without CUDA";
  return false;
}

std::vector<CuptiRecord> CuptiRecorder::stop() { return {}; }

}  // namespace sbp

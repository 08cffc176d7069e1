// cupti_recorder.h for builds without CUDA: nothing to record. The timeline merge (cupti_timeline.cpp) and the
// writers (cupti_export.cpp) need no CUDA and are in both builds.
#include "profiler/cupti_recorder.h"

namespace sbp {

CuptiRecorder::~CuptiRecorder() = default;

bool CuptiRecorder::start(std::string* reason) {
  if (reason) *reason = "built without CUDA";
  return false;
}

CuptiRecording CuptiRecorder::stop() { return {}; }

}  // namespace sbp

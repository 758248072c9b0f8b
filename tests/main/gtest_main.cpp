// GoogleTest main that exits 77 when every test it ran was skipped (no GPU, too few GPUs), so
// CTest's SKIP_RETURN_CODE reports the test as skipped rather than passed.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const auto* u = ::testing::UnitTest::GetInstance();
  if (rc == 0 && u->skipped_test_count() > 0 && u->successful_test_count() == 0) return 77;
  return rc;
}

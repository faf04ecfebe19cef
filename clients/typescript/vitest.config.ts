import { defineConfig } from "vitest/config";

export default defineConfig({
  test: {
    globalSetup: ["test/setup.ts"],
    include: ["test/**/*.test.{ts,tsx}"],
    testTimeout: 20_000,
  },
});

package org.apache.spark.kafka010;

import java.util.HashMap;
import java.util.Map;

/** Drop-in for Spark's KafkaConfigUpdater without delegation-token support (see README.md). */
public class KafkaConfigUpdater {
  private final String module;
  private final Map<String, Object> map = new HashMap<>();

  @SuppressWarnings("unchecked")
  public KafkaConfigUpdater(String module, scala.collection.immutable.Map<String, Object> kafkaParams) {
    this.module = module;
    map.putAll(scala.jdk.javaapi.CollectionConverters.asJava(kafkaParams));
  }

  public KafkaConfigUpdater set(String key, Object value) {
    map.put(key, value);
    return this;
  }

  public KafkaConfigUpdater setIfUnset(String key, Object value) {
    map.putIfAbsent(key, value);
    return this;
  }

  /** Delegation tokens are not supported by this replacement: authentication comes from kafka.* options. */
  public KafkaConfigUpdater setAuthenticationConfigIfNeeded() {
    return this;
  }

  public KafkaConfigUpdater setAuthenticationConfigIfNeeded(scala.Option<?> clusterConfig) {
    return this;
  }

  public Map<String, Object> build() {
    return map;
  }
}

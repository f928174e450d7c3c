package org.apache.spark.kafka010;

import java.util.ArrayList;
import java.util.List;
import java.util.Locale;

/** Drop-in for Spark's KafkaRedactionUtil object: hides secrets in parameters before they are logged. */
public final class KafkaRedactionUtil$ {
  public static final KafkaRedactionUtil$ MODULE$ = new KafkaRedactionUtil$();

  private KafkaRedactionUtil$() {}

  private static boolean secret(String key) {
    String k = key.toLowerCase(Locale.ROOT);
    return k.contains("password") || k.contains("secret") || k.contains("jaas") || k.contains("token");
  }

  public scala.collection.immutable.Seq<scala.Tuple2<String, String>> redactParams(
      scala.collection.immutable.Seq<scala.Tuple2<String, Object>> params) {
    List<scala.Tuple2<String, String>> out = new ArrayList<>();
    for (scala.Tuple2<String, Object> kv : scala.jdk.javaapi.CollectionConverters.asJava(params)) {
      String value = kv._2() == null ? "null" : kv._2().toString();
      out.add(new scala.Tuple2<>(kv._1(), secret(kv._1()) ? "*********(redacted)" : value));
    }
    return scala.jdk.javaapi.CollectionConverters.asScala(out).toList();
  }
}
